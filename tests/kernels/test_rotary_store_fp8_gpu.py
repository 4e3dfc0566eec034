"""GPU: the fused rotary + KV-store kernel's FP8 (e4m3) form at the Llama-3.1-8B shape (32 q heads, 8 kv
heads, head_dim 128) against the unfused path (engine apply_rotary on q and k in the model dtype, then the
Triton store_kv_fp8) and the plain-torch reference, bitwise; its q bitwise the bf16-cache fused path's;
bitwise batch invariance; CUDA-graph capture; and a model over an FP8 cache giving the same logits with
the fused kernel and with DEEPINFER_DISABLE_FUSED_ROPE=1.
"""

from __future__ import annotations

import os

import pytest
import torch
from deepinfer.engine.layers.rotary import RotaryEmbedding, apply_rotary
from deepinfer.engine.models.config import RopeScaling
from deepinfer.kernels.reference.kv_fp8 import FP8_DTYPE
from deepinfer.kernels.reference.rotary_store import rotary_store_kv_fp8_ref

from tests.kernels.test_rotary_store_fp8_cpu import bf16_cache_case, bits, fresh_fp8_caches, make_fp8_case

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
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: the GPU tests need compiled kernels")
    from deepinfer.kernels import kv_fp8, rotary_store

    return rotary_store, kv_fp8


def _engine_case(num_tokens: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """make_fp8_case's operands on the GPU at the 8B shape, cos/sin rows from the engine's rotary table."""
    case = make_fp8_case(num_tokens, HQ, HKV, D, dtype=dtype, block_size=16, seed=seed,
                         padded=tuple(range(3, num_tokens, 17)), device=DEV)
    rope = RotaryEmbedding(D, 131072, 500000.0, LLAMA3, device=torch.device(DEV))
    gen = torch.Generator().manual_seed(seed + 1)
    positions = torch.randint(0, 131072, (num_tokens,), generator=gen).to(DEV)
    cos, sin = rope(positions, dtype)
    case.update(cos=cos.squeeze(1), sin=sin.squeeze(1))
    return case


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
    full = fresh_fp8_caches(c)
    q_full = kern[0].rotary_store_kv(**full)
    bs = c["k_cache"].shape[1]
    names = ("q", "k", "v", "cos", "sin", "slot_mapping")
    for size in (1, 7, 64, 256):
        for lo in (0, 256 - size):
            part = fresh_fp8_caches({**c, **{n: c[n][lo:lo + size] for n in names}})
            assert torch.equal(kern[0].rotary_store_kv(**part), q_full[lo:lo + size]), (size, lo)
            slots = c["slot_mapping"][lo:lo + size]
            slots = slots[slots >= 0].long()
            blk, off = slots // bs, slots % bs
            assert torch.equal(bits(part["k_cache"][blk, off]), bits(full["k_cache"][blk, off])), (size, lo)
            assert torch.equal(bits(part["v_cache"][blk, off]), bits(full["v_cache"][blk, off])), (size, lo)


def test_captures_into_a_cuda_graph(kern):
    c = _engine_case(256, BF16, seed=5)
    want = fresh_fp8_caches(c)
    q_want = kern[0].rotary_store_kv(**want)
    got = fresh_fp8_caches(c)
    kern[0].rotary_store_kv(**fresh_fp8_caches(c))          # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out = kern[0].rotary_store_kv(**got)
    got["k_cache"].copy_(c["k_cache"])
    got["v_cache"].copy_(c["v_cache"])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(q_out, q_want)
    assert torch.equal(bits(got["k_cache"]), bits(want["k_cache"]))
    assert torch.equal(bits(got["v_cache"]), bits(want["v_cache"]))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_model_logits_same_with_and_without_fused_rope(kern, arch, tiny_checkpoint, monkeypatch):
    from deepinfer.engine.layers.attention import PagedSelfAttention
    from deepinfer.engine.layers.backends import make_ops
    from deepinfer.engine.layers.cuda_ops import DISABLE_FUSED_ROPE_ENV
    from deepinfer.engine.models.config import ModelConfig
    from deepinfer.engine.models.loader import iter_weights
    from deepinfer.engine.models.registry import build_model

    from tests.support.paged_runner import PagedBatchRunner

    path = tiny_checkpoint(arch)
    cfg = ModelConfig.from_dir(path)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (5, 37, 18)]
    calls = []
    fused = kern[0].rotary_store_kv
    monkeypatch.setattr(kern[0], "rotary_store_kv", lambda *a: calls.append(1) or fused(*a))
    logits = {}
    for disabled in ("1", ""):
        calls.clear()
        monkeypatch.setenv(DISABLE_FUSED_ROPE_ENV, disabled)
        ops = make_ops(DEV, deterministic=True)
        assert ops.fused_rope is (disabled != "1")
        model = build_model(cfg, ops, BF16, torch.device(DEV))
        model.load_weights(iter_weights(path, torch.device(DEV)))
        layers = [m for m in model.modules() if isinstance(m, PagedSelfAttention)]
        assert len(layers) == cfg.num_hidden_layers
        for i, layer in enumerate(layers):   # per-head scales that are not all 1.0
            heads = torch.arange(layer.num_kv_heads, device=DEV, dtype=torch.float32)
            layer.k_scale.copy_(0.05 + 0.01 * (heads + i))
            layer.v_scale.copy_(0.02 + 0.005 * (heads + i))
        runner = PagedBatchRunner(model, cfg)
        shape = runner.kv[0][0].shape   # NaN-filled: unwritten slots must never reach a result
        runner.kv = [tuple(torch.full(shape, float("nan"), dtype=FP8_DTYPE, device=DEV) for _ in range(2))
                     for _ in range(cfg.num_hidden_layers)]
        for i, p in enumerate(prompts):
            runner.add(f"s{i}", p)
        steps = [runner.step([(f"s{i}", len(p)) for i, p in enumerate(prompts)])]
        for t in range(3):
            for i in range(3):
                runner.append(f"s{i}", (7 * t + i) % cfg.vocab_size)
            steps.append(runner.step([(f"s{i}", 1) for i in range(3)]))
        logits[disabled] = steps
        assert len(calls) == (0 if disabled else 4 * cfg.num_hidden_layers)   # 4 steps, one launch a layer
    for step_fused, step_unfused in zip(logits[""], logits["1"]):
        for name in step_fused:
            assert torch.isfinite(step_fused[name]).all(), f"{arch} {name}"
            assert torch.equal(step_fused[name], step_unfused[name]), f"{arch} {name}"
