"""The qkv rope-epilogue wiring on CPU: where the backend says so (`Ops.rope_in_16bit_qkv`, the deterministic
CUDA backend's), each qualifying attention layer gets its qkv rows (and bias) in per-head pair order after
loading, and runs `Ops.qkv_rope_store` instead of linear + rotary_store_kv, with the same logits bit for bit.

CPU runs the shared composition of `qkv_rope_store` (linear over the reordered rows, the columns put back in
order, rotary_store_kv), so this checks the reorder, the flags, which layers qualify and the engine's call;
the kernel's own equality is tests/kernels/test_rope_epilogue_interpreted.py's.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from deepinfer.engine.layers.attention import PagedSelfAttention, order_qkv_for_rope
from deepinfer.engine.layers.cpu_ops import CpuInvariantOps
from deepinfer.kernels.reference.rope_layout import interleave_head_halves

from tests.support.paged_runner import two_prompt_logits


class _RopeOps(CpuInvariantOps):
    rope_in_16bit_qkv = True

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def qkv_rope_store(self, x, weight, bias, rope):
        self.calls["qkv_rope_store"] += 1
        return super().qkv_rope_store(x, weight, bias, rope)

    def rotary_store_kv(self, *args):
        self.calls["rotary_store_kv"] += 1
        return super().rotary_store_kv(*args)


def _model(path, ops, dtype):
    from deepinfer.engine.models.config import ModelConfig
    from deepinfer.engine.models.loader import iter_weights
    from deepinfer.engine.models.registry import build_model

    cfg = ModelConfig.from_dir(path)
    model = build_model(cfg, ops, dtype, "cpu")
    model.load_weights(iter_weights(path, "cpu"))
    return model, cfg


# (arch, dtype, cache dtype, reordered): llama; qwen2 (a qkv bias, reordered with the rows); qwen3 (q/k norms
# sit between the projection and the rotation: unfused); float32 (the epilogue is 16-bit only); an e4m3
# cache (the fused kernel's FP8 form stays).
CASES = [
    ("llama", torch.bfloat16, torch.bfloat16, True),
    ("qwen2", torch.float16, torch.float16, True),
    ("qwen3", torch.bfloat16, torch.bfloat16, False),
    ("llama", torch.float32, torch.float32, False),
    ("llama", torch.bfloat16, torch.float8_e4m3fn, False),
]


@pytest.mark.parametrize("arch,dtype,cache_dtype,reordered", CASES)
def test_rope_epilogue_wiring_gives_the_same_logits(tiny_checkpoint, arch, dtype, cache_dtype, reordered):
    path = tiny_checkpoint(arch)
    plain, cfg = _model(path, CpuInvariantOps(), dtype)
    ops = _RopeOps()
    fused, _ = _model(path, ops, dtype)
    layers = order_qkv_for_rope(fused, cache_dtype)
    assert layers == (cfg.num_hidden_layers if reordered else 0)
    attn = [m for m in fused.modules() if isinstance(m, PagedSelfAttention)]
    assert attn and all(m.rope_in_qkv == reordered for m in attn)
    if cache_dtype == dtype:   # the runner's caches are in the model dtype
        for a, b in zip(two_prompt_logits(plain, cfg, 2), two_prompt_logits(fused, cfg, 2), strict=True):
            assert torch.equal(a, b)
        steps = 3 * cfg.num_hidden_layers
        assert ops.calls["qkv_rope_store"] == (steps if reordered else 0)
        # The shared composition runs rotary_store_kv itself: once per layer and step either way.
        assert ops.calls["rotary_store_kv"] == steps
    if reordered:
        name = next(n for n, m in fused.named_modules() if isinstance(m, PagedSelfAttention))
        p, f = dict(plain.named_modules())[name].qkv_proj, dict(fused.named_modules())[name].qkv_proj
        assert torch.equal(f.weight, interleave_head_halves(p.weight, cfg.head_dim))
        if p.bias is not None:
            assert torch.equal(f.bias, interleave_head_halves(p.bias, cfg.head_dim))


def test_the_reorder_runs_once(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    plain, cfg = _model(path, CpuInvariantOps(), torch.bfloat16)
    fused, _ = _model(path, _RopeOps(), torch.bfloat16)
    assert order_qkv_for_rope(fused, torch.bfloat16) == cfg.num_hidden_layers
    assert order_qkv_for_rope(fused, torch.bfloat16) == cfg.num_hidden_layers   # marked: left as it is
    for a, b in zip(two_prompt_logits(plain, cfg, 1), two_prompt_logits(fused, cfg, 1), strict=True):
        assert torch.equal(a, b)


def test_a_reordered_layer_given_another_cache_dtype_puts_its_columns_back(tiny_checkpoint):
    # Not a layout the engine builds (it orders the rows for the cache dtype it allocates), kept exact: the
    # unfused path takes the projection's columns back to their order first.
    path = tiny_checkpoint("llama")
    plain, cfg = _model(path, CpuInvariantOps(), torch.bfloat16)
    fused, _ = _model(path, _RopeOps(), torch.bfloat16)
    order_qkv_for_rope(fused, torch.bfloat16)
    for m in fused.modules():
        if isinstance(m, PagedSelfAttention):
            m.ops.rope_in_16bit_qkv = False
    x = torch.randn(5, cfg.hidden_size, dtype=torch.bfloat16)
    attn_p = next(m for m in plain.modules() if isinstance(m, PagedSelfAttention))
    attn_f = next(m for m in fused.modules() if isinstance(m, PagedSelfAttention))
    got = attn_f._attend(x, *_rope_rows(5, cfg.head_dim), *_meta_and_caches(5, cfg))
    want = attn_p._attend(x, *_rope_rows(5, cfg.head_dim), *_meta_and_caches(5, cfg))
    assert torch.equal(got, want)


def _rope_rows(tokens, d):
    angles = torch.arange(tokens, dtype=torch.float32)[:, None] * torch.linspace(0.1, 1.0, d)[None, :]
    return angles.cos().to(torch.bfloat16)[:, None], angles.sin().to(torch.bfloat16)[:, None]


def _meta_and_caches(tokens, cfg):
    from tests.support.paged_batches import SeqStep, build_metadata

    meta = build_metadata([SeqStep(blocks=[2, 0], context_len=tokens, query_len=tokens)], block_size=4)
    shape = (4, 4, cfg.num_key_value_heads, cfg.head_dim)
    return meta, torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
