"""GPU: the fused MoE's clipped-SwiGLU variant at a DeepSeek-V4-like expert shape (E=32, H=4096, I=2048,
top-6) against the float32 reference, bitwise batch invariance, and V4MoE on CUDA taking the fused path
(no less precise than the per-expert reference path it replaced, and batch-invariant in deterministic mode).
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.kernels.reference.fused_moe import fused_moe_ref

from tests.support.moe_inputs import expert_weights, routed_tokens

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
EXPERTS, TOP_K, HIDDEN, INTER = 32, 6, 4096, 2048
# Pre-activations are ~N(0, 1) here: a limit of 1 clips ~16% of gates and ~32% of ups (V4's own default of
# 10 is never reached by random weights, so it would not test the clamp).
LIMIT = 1.0


@pytest.fixture(scope="module")
def weights():
    return expert_weights(EXPERTS, HIDDEN, INTER, CUDA)


def _tokens(n, seed, skew=False):
    return routed_tokens(n, seed, HIDDEN, EXPERTS, TOP_K, CUDA, skew)


@pytest.mark.parametrize("n,skew", [(1, False), (37, False), (300, True)])
def test_clipped_fused_moe_matches_reference(weights, n, skew):
    from deepinfer.kernels.fused_moe import fused_moe

    x, ids, w = _tokens(n, seed=n, skew=skew)
    ref = fused_moe_ref(x, ids, w, *weights, swiglu_limit=LIMIT).float()
    plain = fused_moe_ref(x, ids, w, *weights).float()
    assert (ref - plain).abs().max() > 0.1            # the clamp matters at this limit
    for invariant in (True, False):          # fast mode takes 16-row blocks for n = 1 and 37
        got = fused_moe(x, ids, w, *weights, invariant=invariant, swiglu_limit=LIMIT)
        # bf16 intermediate h (rounded before the down GEMM) and output: a few bf16 ulps of outputs ~O(1).
        torch.testing.assert_close(got.float(), ref, atol=3e-2, rtol=3e-2)


def test_clipped_fused_moe_token_bits_do_not_depend_on_other_tokens(weights):
    from deepinfer.kernels.fused_moe import fused_moe

    x, ids, w = _tokens(400, seed=7, skew=True)
    full = fused_moe(x, ids, w, *weights, swiglu_limit=LIMIT)
    gen = torch.Generator().manual_seed(1)
    for size in (1, 7, 33, 129):
        for _ in range(3):
            pick = torch.randperm(400, generator=gen)[:size].to(CUDA)
            part = fused_moe(x[pick], ids[pick], w[pick], *weights, swiglu_limit=LIMIT)
            assert torch.equal(part, full[pick]), f"batch of {size}"
    crowd_ids = ids[:1].expand(90, -1).contiguous()     # every other token on the same experts
    crowd_x = torch.cat([x[:1], torch.randn(89, HIDDEN, device=CUDA).bfloat16()])
    crowd = fused_moe(crowd_x, crowd_ids, w[:1].expand(90, -1).contiguous(), *weights, swiglu_limit=LIMIT)
    assert torch.equal(crowd[0], full[0])


@pytest.fixture(scope="module")
def v4_moe():
    """A top-k routed V4MoE layer (sqrtsoftplus router, clipped experts and shared expert) on CUDA in bf16,
    deterministic ops, random weights."""
    from deepinfer.engine.layers.backends import make_ops
    from deepinfer.engine.layers.hash_moe import V4MoE
    from deepinfer.engine.models.deepseek_v4_config import DeepseekV4Config

    cfg = DeepseekV4Config.from_dict({
        "hidden_size": 1024, "moe_intermediate_size": 512, "n_routed_experts": EXPERTS,
        "num_experts_per_tok": TOP_K, "num_hidden_layers": 2, "mlp_layer_types": ["hash_moe", "moe"],
        "vocab_size": 1000, "swiglu_limit": LIMIT, "num_attention_heads": 4, "head_dim": 64,
    })
    ops = make_ops(CUDA, True)
    moe = V4MoE(cfg, 1, ops, torch.bfloat16, CUDA)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in moe.parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.copy_((torch.randn(p.shape, generator=gen) / fan_in ** 0.5).to(p.dtype))
    return moe, ops


def test_v4_moe_on_cuda_runs_the_fused_clipped_kernel(v4_moe):
    """V4MoE's routed part is the fused kernel's result (bitwise), at least as close to the float32 result
    as the per-expert reference path (Ops.routed_experts' shared version) it replaced on CUDA: on average,
    and in the worst element within a margin (both round the output to bf16 once, which dominates it)."""
    from deepinfer.engine.layers.ops import Ops
    from deepinfer.kernels.fused_moe import fused_moe

    moe, ops = v4_moe
    hidden = moe.experts.gate_up_proj.shape[-1]
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(200, hidden, generator=gen).bfloat16().to(CUDA)
    input_ids = torch.randint(0, 1000, (200,), generator=gen).to(CUDA)
    ex = moe.experts
    with torch.no_grad():
        weights, ids = moe.gate(x, input_ids)
        fused = fused_moe(x, ids, weights, ex.gate_up_proj, ex.down_proj, swiglu_limit=LIMIT)
        assert torch.equal(moe(x, input_ids), fused + moe.shared_experts(x))
        per_expert = Ops.routed_experts(ops, x, ids, weights, ex.gate_up_proj, ex.down_proj,
                                        swiglu_limit=LIMIT)
    exact = fused_moe_ref(x.float(), ids, weights, ex.gate_up_proj.float(), ex.down_proj.float(),
                          swiglu_limit=LIMIT)
    err, ref_err = (fused.float() - exact).abs(), (per_expert.float() - exact).abs()
    assert err.mean() <= ref_err.mean(), (err.mean(), ref_err.mean())
    assert err.max() <= 1.25 * ref_err.max(), (err.max(), ref_err.max())


def test_v4_moe_on_cuda_is_batch_invariant(v4_moe):
    moe, _ = v4_moe
    hidden = moe.experts.gate_up_proj.shape[-1]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(256, hidden, generator=gen).bfloat16().to(CUDA)
    input_ids = torch.randint(0, 1000, (256,), generator=gen).to(CUDA)
    with torch.no_grad():
        full = moe(x, input_ids)
        for size in (1, 5, 64):
            pick = torch.randperm(256, generator=gen)[:size].to(CUDA)
            assert torch.equal(moe(x[pick], input_ids[pick]), full[pick]), f"batch of {size}"
