"""GPU: the fused rotary + KV-store kernel at Llama-3.1-8B and Qwen2.5-0.5B shapes against today's unfused
path (engine apply_rotary on q and k in the model dtype, then the Triton store_kv), bitwise; bitwise batch
invariance at batch sizes 1, 7, 64, 256; CUDA-graph capture; and a model on CUDA giving the same logits with
the kernel and with DEEPINFER_DISABLE_FUSED_ROPE=1.
"""

from __future__ import annotations

import os

import pytest
import torch
from deepinfer.engine.layers.rotary import RotaryEmbedding, apply_rotary
from deepinfer.engine.models.config import RopeScaling
from deepinfer.kernels.reference.rotary_store import rotary_store_kv_ref

from tests.kernels.test_rotary_store_cpu import fresh_caches, make_case

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
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: the GPU tests need compiled kernels")
    from deepinfer.kernels import rotary_store, store_kv

    return rotary_store, store_kv


def _engine_case(shape: str, num_tokens: int, dtype: torch.dtype, seed: int = 0) -> dict:
    """make_case's operands on the GPU, with cos/sin rows from the engine's own rotary table."""
    hq, hkv, d, theta, scaling = SHAPES[shape]
    case = make_case(num_tokens, hq, hkv, d, dtype=dtype, block_size=16, seed=seed,
                     padded=tuple(range(3, num_tokens, 17)), device=DEV)
    rope = RotaryEmbedding(d, 131072, theta, scaling, device=torch.device(DEV))
    gen = torch.Generator().manual_seed(seed + 1)
    positions = torch.randint(0, 131072, (num_tokens,), generator=gen).to(DEV)
    cos, sin = rope(positions, dtype)
    case.update(cos=cos.squeeze(1), sin=sin.squeeze(1))
    return case


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
    c = _engine_case(shape, 256, BF16, seed=3)
    full = fresh_caches(c)
    q_full = kern[0].rotary_store_kv(**full)
    bs = c["k_cache"].shape[1]
    for size in (1, 7, 64, 256):
        for lo in (0, 256 - size):
            part = fresh_caches({**c, **{n: c[n][lo:lo + size] for n in ("q", "k", "v", "cos", "sin",
                                                                           "slot_mapping")}})
            assert torch.equal(kern[0].rotary_store_kv(**part), q_full[lo:lo + size]), (size, lo)
            slots = c["slot_mapping"][lo:lo + size]
            slots = slots[slots >= 0].long()
            blk, off = slots // bs, slots % bs
            assert torch.equal(part["k_cache"][blk, off], full["k_cache"][blk, off]), (size, lo)
            assert torch.equal(part["v_cache"][blk, off], full["v_cache"][blk, off]), (size, lo)


def test_captures_into_a_cuda_graph(kern):
    c = _engine_case("llama-3.1-8b", 64, BF16, seed=5)
    want = fresh_caches(c)
    q_want = kern[0].rotary_store_kv(**want)
    got = fresh_caches(c)
    kern[0].rotary_store_kv(**fresh_caches(c))          # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out = kern[0].rotary_store_kv(**got)
    got["k_cache"].copy_(c["k_cache"])
    got["v_cache"].copy_(c["v_cache"])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(q_out, q_want)
    assert torch.equal(got["k_cache"], want["k_cache"]) and torch.equal(got["v_cache"], want["v_cache"])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_model_logits_same_with_and_without_fused_rope(kern, arch, tiny_checkpoint, monkeypatch):
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
        runner = PagedBatchRunner(model, cfg)
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
            assert torch.equal(step_fused[name], step_unfused[name]), f"{arch} {name}"
