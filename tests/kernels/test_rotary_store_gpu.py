"""GPU: the fused rotary + KV-store kernel at Llama-3.1-8B and Qwen2.5-0.5B shapes against today's unfused
path (engine apply_rotary on q and k in the model dtype, then the Triton store_kv), bitwise; bitwise batch
invariance at batch sizes 1, 7, 64, 256; CUDA-graph capture; and a model on CUDA giving the same logits with
the kernel and with DEEPINFER_DISABLE_FUSED_ROPE=1.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine.layers.rotary import apply_rotary
from deepinfer.engine.models.config import RopeScaling
from deepinfer.kernels.reference.rotary_store import rotary_store_kv_ref

from tests.kernels.test_rotary_store_cpu import fresh_caches, make_case
from tests.support.rotary_store_checks import (
    check_captures_into_a_cuda_graph,
    check_model_logits_with_and_without_fused_rope,
    check_token_bits_batch_invariant,
    compiled_kernels,
    with_engine_rotary,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
BF16 = torch.bfloat16
# name -> (Hq, Hkv, head_dim, rope theta, llama3 scaling)
SHAPES = {
    "llama-3.1-8b": (32, 8, 128, 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)),
    "qwen2.5-0.5b": (14, 2, 64, 1000000.0, None),
}


@pytest.fixture(scope="module")
def kern():
    return compiled_kernels("rotary_store", "store_kv")


def _engine_case(shape: str, num_tokens: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """make_case's operands on the GPU, with cos/sin rows from the engine's own rotary table."""
    hq, hkv, d, theta, scaling = SHAPES[shape]
    case = make_case(num_tokens, hq, hkv, d, dtype=dtype, block_size=16, seed=seed,
                     padded=tuple(range(3, num_tokens, 17)), device=DEV)
    return with_engine_rotary(case, d, theta, scaling, dtype, seed)


def _today(kern, c: dict) -> torch.Tensor:
    """The unfused path the attention layer ran before the fused op: rotate q, rotate k, store_kv."""
    cos, sin = c["cos"][:, None], c["sin"][:, None]
    q, k = apply_rotary(c["q"], cos, sin), apply_rotary(c["k"], cos, sin)
    kern[1].store_kv(k, c["v"], c["k_cache"], c["v_cache"], c["slot_mapping"])
    return q


@pytest.mark.parametrize("dtype", [BF16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 7, 256, 4096])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fused_is_bitwise_todays_path(kern, shape, num_tokens, dtype):
    c = _engine_case(shape, num_tokens, dtype)
    fused, today, ref = fresh_caches(c), fresh_caches(c), fresh_caches(c)
    q_fused = kern[0].rotary_store_kv(**fused)
    q_today = _today(kern, today)
    q_ref = rotary_store_kv_ref(**ref)
    assert torch.equal(q_fused, q_today), f"q: {(q_fused != q_today).sum().item()} elements differ"
    assert torch.equal(fused["k_cache"], today["k_cache"]), "k_cache differs"
    assert torch.equal(fused["v_cache"], today["v_cache"]), "v_cache differs"
    assert torch.equal(q_fused, q_ref) and torch.equal(fused["k_cache"], ref["k_cache"])


@pytest.mark.parametrize("shape", list(SHAPES))
def test_token_bits_are_batch_invariant(kern, shape):
    check_token_bits_batch_invariant(kern[0].rotary_store_kv, _engine_case(shape, 256, BF16, seed=3),
                                     fresh_caches)


def test_captures_into_a_cuda_graph(kern):
    check_captures_into_a_cuda_graph(kern[0].rotary_store_kv, _engine_case("llama-3.1-8b", 64, BF16, seed=5),
                                     fresh_caches)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_model_logits_same_with_and_without_fused_rope(kern, arch, tiny_checkpoint, monkeypatch):
    check_model_logits_with_and_without_fused_rope(kern[0], arch, tiny_checkpoint(arch), monkeypatch)
