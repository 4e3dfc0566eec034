"""The MLA and MoE references: absorbed == expanded attention, routers == transformers', batch invariance."""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine.layers.cpu_ops import CpuInvariantOps
from deepinfer.kernels.reference.mla import (
    chunked_mla_attention,
    mla_attention_ref,
    split_kv_b,
    store_mla_ref,
)
from deepinfer.kernels.reference.moe import route_noaux_tc, route_softmax

from tests.support.paged_batches import SeqStep, build_metadata, random_block_lists

HEADS, NOPE, ROPE, RANK, V = 4, 16, 8, 32, 12
BLOCK = 16


def _mla_case(context_lens, query_lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lists, num_blocks = random_block_lists(context_lens, BLOCK, seed=seed)
    meta = build_metadata([SeqStep(b, c, q) for b, c, q in zip(lists, context_lens, query_lens)], BLOCK)
    cache = torch.full((num_blocks, BLOCK, RANK + ROPE), float("nan"))
    # Fill every position of every context (earlier steps wrote them); unused slots stay NaN.
    for blocks, ctx in zip(lists, context_lens):
        pos = torch.arange(ctx)
        slots = torch.tensor(blocks)[pos // BLOCK] * BLOCK + pos % BLOCK
        latent, k_pe = torch.randn(ctx, RANK, generator=gen), torch.randn(ctx, ROPE, generator=gen)
        store_mla_ref(latent, k_pe, cache, slots)
    t = meta.num_tokens
    q_nope = torch.randn(t, HEADS, NOPE, generator=gen)
    q_pe = torch.randn(t, HEADS, ROPE, generator=gen)
    kv_b = 0.2 * torch.randn(HEADS * (NOPE + V), RANK, generator=gen)
    return q_nope, q_pe, cache, meta, kv_b


def test_absorbed_chunked_attention_equals_expanded_reference():
    q_nope, q_pe, cache, meta, kv_b = _mla_case([37, 5, 70, 16], [37, 1, 9, 1])
    scale = (NOPE + ROPE) ** -0.5
    expanded = mla_attention_ref(q_nope, q_pe, cache, meta, kv_b, scale, absorb_decode=False)
    absorbed = mla_attention_ref(q_nope, q_pe, cache, meta, kv_b, scale, absorb_decode=True)
    w_uk, w_uv = split_kv_b(kv_b, HEADS, NOPE)
    q_abs = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe], dim=-1)
    o_lat = chunked_mla_attention(q_abs, cache, meta, scale, RANK)
    chunked = torch.einsum("thr,hvr->thv", o_lat, w_uv)
    assert torch.isfinite(chunked).all()
    torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked, expanded, atol=1e-5, rtol=1e-5)


def test_deterministic_mla_rows_do_not_depend_on_the_batch():
    ops = CpuInvariantOps()
    q_nope, q_pe, cache, meta, kv_b = _mla_case([37, 5, 70], [37, 1, 9])
    together = ops.mla_attention(q_nope, q_pe, cache, meta, kv_b, 0.2)
    # The last sequence's 9 query rows alone, its context unchanged.
    lists = [meta.block_tables[2, : -(-70 // BLOCK)].tolist()]
    alone_meta = build_metadata([SeqStep(lists[0], 70, 9)], BLOCK)
    alone = ops.mla_attention(q_nope[-9:], q_pe[-9:], cache, alone_meta, kv_b, 0.2)
    assert torch.equal(together[-9:], alone)


def test_store_skips_padding_slots():
    cache = torch.zeros(2, BLOCK, 3)
    store_mla_ref(torch.ones(2, 2), torch.full((2, 1), 2.0), cache, torch.tensor([5, -1]))
    assert cache[0, 5].tolist() == [1.0, 1.0, 2.0] and cache.sum() == 4.0


def _hf_router(kind: str, **fields):
    import transformers as tf

    if kind == "v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        cfg = tf.DeepseekV3Config(hidden_size=32, **fields)
        router = DeepseekV3TopkRouter(cfg)
        router.e_score_correction_bias.copy_(0.1 * torch.randn(cfg.n_routed_experts))
    else:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

        cfg = tf.DeepseekV2Config(hidden_size=32, num_attention_heads=4, **fields)
        router = DeepseekV2TopkRouter(cfg)
    torch.nn.init.normal_(router.weight, std=0.3)
    return router


ROUTERS = {
    "v3_grouped_norm": ("v3", dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                   norm_topk_prob=True, routed_scaling_factor=2.5)),
    "v3_plain": ("v3", dict(n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                            norm_topk_prob=False, routed_scaling_factor=1.0)),
    "v2_greedy": ("v2", dict(n_routed_experts=8, num_experts_per_tok=3, topk_method="greedy",
                             routed_scaling_factor=1.5)),
    "v2_grouped": ("v2", dict(n_routed_experts=8, num_experts_per_tok=2, topk_method="group_limited_greedy",
                              n_group=4, topk_group=2, routed_scaling_factor=1.0)),
}


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("name", list(ROUTERS))
def test_routing_matches_transformers(name, invariant):
    torch.manual_seed(0)
    kind, fields = ROUTERS[name]
    router = _hf_router(kind, **fields)
    x = torch.randn(50, 32)
    with torch.no_grad():
        logits, hf_w, hf_ids = router(x)
        order = hf_ids.argsort(dim=-1)
        hf_ids, hf_w = hf_ids.gather(1, order), hf_w.gather(1, order)
        if kind == "v3":
            w, ids = route_noaux_tc(logits, router.e_score_correction_bias, router.top_k, router.num_group,
                                    router.topk_group, router.norm_topk_prob, router.routed_scaling_factor,
                                    invariant=invariant)
        else:
            w, ids = route_softmax(logits, router.top_k, router.topk_method, router.num_group,
                                   router.topk_group, router.routed_scaling_factor, invariant=invariant)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(w, hf_w, atol=1e-6, rtol=1e-6)


def test_moe_layer_rows_do_not_depend_on_other_tokens():
    """A token's MoE output is bitwise the same alone and among tokens that share its experts."""
    from deepinfer.engine.layers.moe import DeepseekMoE
    from deepinfer.engine.models.deepseek_config import MoEConfig

    cfg = MoEConfig(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
                    topk_method="noaux_tc", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                    norm_topk_prob=True, first_k_dense_replace=0)
    moe = DeepseekMoE(cfg, 32, False, CpuInvariantOps(), torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        x = torch.randn(45, 32, generator=gen)
        together = moe(x)
        for i in (0, 17, 44):
            assert torch.equal(moe(x[i:i + 1]), together[i:i + 1])
            assert torch.equal(moe(x[i:i + 5]), together[i:i + 5])
