"""GPU: the fused rotary + KV-store kernel's FP8 (e4m3) form at the Llama-3.1-8B shape (32 q heads, 8 kv
heads, head_dim 128) against the unfused path (engine apply_rotary on q and k in the model dtype, then the
Triton store_kv_fp8) and the plain-torch reference, bitwise; its q bitwise the bf16-cache fused path's;
bitwise batch invariance; CUDA-graph capture; and a model over an FP8 cache giving the same logits with
the fused kernel and with DEEPINFER_DISABLE_FUSED_ROPE=1.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine.layers.rotary import apply_rotary
from deepinfer.engine.models.config import RopeScaling
from deepinfer.kernels.reference.kv_fp8 import FP8_DTYPE
from deepinfer.kernels.reference.rotary_store import rotary_store_kv_fp8_ref

from tests.kernels.test_rotary_store_fp8_cpu import bf16_cache_case, bits, fresh_fp8_caches, make_fp8_case
from tests.support.rotary_store_checks import (
    check_captures_into_a_cuda_graph,
    check_model_logits_with_and_without_fused_rope,
    check_token_bits_batch_invariant,
    compiled_kernels,
    with_engine_rotary,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs an FP8 GPU (compute capability >= 8.9)"),
]

DEV = "cuda"
BF16 = torch.bfloat16
HQ, HKV, D = 32, 8, 128   # Llama-3.1-8B
LLAMA3 = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


@pytest.fixture(scope="module")
def kern():
    return compiled_kernels("rotary_store", "kv_fp8")


def _engine_case(num_tokens: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """make_fp8_case's operands on the GPU at the 8B shape, cos/sin rows from the engine's rotary table."""
    case = make_fp8_case(num_tokens, HQ, HKV, D, dtype=dtype, block_size=16, seed=seed,
                         padded=tuple(range(3, num_tokens, 17)), device=DEV)
    return with_engine_rotary(case, D, 500000.0, LLAMA3, dtype, seed)


def _today(kern, c: dict) -> torch.Tensor:
    """The unfused path the attention layer ran before the fused op: rotate q, rotate k, store_kv_fp8."""
    cos, sin = c["cos"][:, None], c["sin"][:, None]
    q, k = apply_rotary(c["q"], cos, sin), apply_rotary(c["k"], cos, sin)
    kern[1].store_kv_fp8(k, c["v"], c["k_cache"], c["v_cache"], c["slot_mapping"], c["k_scale"], c["v_scale"])
    return q


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 7, 256, 4096])
def test_fused_is_bitwise_todays_path(kern, num_tokens, dtype):
    c = _engine_case(num_tokens, dtype)
    fused, today, ref = fresh_fp8_caches(c), fresh_fp8_caches(c), fresh_fp8_caches(c)
    q_fused = kern[0].rotary_store_kv(**fused)
    q_today = _today(kern, today)
    q_ref = rotary_store_kv_fp8_ref(**ref)
    assert torch.equal(q_fused, q_today), f"q: {(q_fused != q_today).sum().item()} elements differ"
    assert torch.equal(q_fused, q_ref)
    assert torch.equal(q_fused, kern[0].rotary_store_kv(**bf16_cache_case(c)))   # the bf16-cache path's q
    for name, other in (("today", today), ("reference", ref)):
        for cache in ("k_cache", "v_cache"):
            diff = (bits(fused[cache]) != bits(other[cache])).sum().item()
            assert diff == 0, f"{cache} vs {name}: {diff} bytes differ"


def test_token_bits_are_batch_invariant(kern):
    c = _engine_case(256, BF16, seed=3)
    check_token_bits_batch_invariant(kern[0].rotary_store_kv, c, fresh_fp8_caches, view=bits)


def test_captures_into_a_cuda_graph(kern):
    c = _engine_case(256, BF16, seed=5)
    check_captures_into_a_cuda_graph(kern[0].rotary_store_kv, c, fresh_fp8_caches, view=bits)


def _fp8_caches_and_scales(model, runner) -> None:
    """Per-head scales that are not all 1.0, and NaN-filled e4m3 caches (an unwritten slot must never reach
    a result)."""
    from deepinfer.engine.layers.attention import PagedSelfAttention

    layers = [m for m in model.modules() if isinstance(m, PagedSelfAttention)]
    assert len(layers) == runner.cfg.num_hidden_layers
    for i, layer in enumerate(layers):
        heads = torch.arange(layer.num_kv_heads, device=DEV, dtype=torch.float32)
        layer.k_scale.copy_(0.05 + 0.01 * (heads + i))
        layer.v_scale.copy_(0.02 + 0.005 * (heads + i))
    shape = runner.kv[0][0].shape
    runner.kv = [tuple(torch.full(shape, float("nan"), dtype=FP8_DTYPE, device=DEV) for _ in range(2))
                 for _ in range(runner.cfg.num_hidden_layers)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_model_logits_same_with_and_without_fused_rope(kern, arch, tiny_checkpoint, monkeypatch):
    check_model_logits_with_and_without_fused_rope(kern[0], arch, tiny_checkpoint(arch), monkeypatch,
                                                   prepare=_fp8_caches_and_scales, finite=True)
