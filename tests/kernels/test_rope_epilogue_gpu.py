"""GPU (bf16): the qkv GEMM with rotary + KV store in its epilogue (kernels/rope_epilogue.py) at the
Qwen2.5-0.5B (bias, 64-dim heads) and Llama-3.1-8B (128-dim heads) shapes, with the planner's configs for
every M bucket (TMA loads, the persistent prefill tiles): the rotated q and both caches are bitwise the plain
GEMM over the original rows followed by the rotary + KV-store kernel, padding slots included, and a token's
bits do not depend on M.
"""

from __future__ import annotations

import os

import pytest
import torch
from deepinfer.kernels.reference.rope_layout import RopeStore, interleave_head_halves

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
# (name, Hq, Hkv, D, K, bias)
SHAPES = [("qwen2.5-0.5b", 14, 2, 64, 896, True), ("llama-3.1-8b", 32, 8, 128, 4096, False)]


@pytest.fixture(scope="module")
def kern():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: the GPU tests need compiled kernels")
    from deepinfer.kernels import matmul, rotary_store

    return matmul, rotary_store


def _case(m, hq, hkv, d, k, bias, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    n = (hq + 2 * hkv) * d
    x = torch.randn(m, k, generator=gen, device=DEV).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen, device=DEV) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=gen, device=DEV).to(torch.bfloat16) if bias else None
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=DEV, dtype=torch.float32) / d))
    pos = torch.randint(0, 32768, (m,), generator=gen, device=DEV)
    emb = torch.cat([pos[:, None] * inv[None, :]] * 2, dim=-1)
    blocks, bs = m // 16 + 4, 16
    slots = torch.randperm(blocks * bs, generator=gen, device=DEV)[:m]
    slots[::5] = -1                                   # padding rows store nothing
    cache = torch.randn(blocks, bs, hkv, d, generator=gen, device=DEV).to(torch.bfloat16)
    return x, w, b, emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16), cache, slots


def _both(kern, m, hq, hkv, d, k, bias):
    mm, rs = kern
    x, w, b, cos, sin, cache, slots = _case(m, hq, hkv, d, k, bias)
    planner = mm.MatmulPlanner()
    want_k, want_v, got_k, got_v = (cache.clone() for _ in range(4))
    q, kk, v = mm.bi_linear(x, w, b, planner=planner).split([hq * d, hkv * d, hkv * d], dim=-1)
    want = rs.rotary_store_kv(q.view(m, hq, d), kk.view(m, hkv, d), v.view(m, hkv, d), cos, sin, want_k,
                              want_v, slots).view(m, hq * d)
    wi, bi = interleave_head_halves(w, d), (interleave_head_halves(b, d) if b is not None else None)
    got = mm.bi_linear(x, wi, bi, planner=planner,
                       rope=RopeStore(cos, sin, got_k, got_v, slots, hq, hkv, d))
    return (got, got_k, got_v), (want, want_k, want_v), x


@pytest.mark.parametrize("m", [1, 7, 64, 200, 256, 2048])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_epilogue_is_bitwise_gemm_then_rotary_store(kern, shape, m):
    _, hq, hkv, d, k, bias = shape
    got, want, _ = _both(kern, m, hq, hkv, d, k, bias)
    for name, g, w in zip(("q", "k_cache", "v_cache"), got, want, strict=True):
        assert torch.equal(g, w), f"{name}: {(g != w).sum().item()} elements differ"


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_a_tokens_q_does_not_depend_on_m(kern, shape):
    _, hq, hkv, d, k, bias = shape
    (big, _, _), _, _ = _both(kern, 300, hq, hkv, d, k, bias)
    for m in (1, 7, 64, 256):
        (small, _, _), _, _ = _both(kern, m, hq, hkv, d, k, bias)
        assert torch.equal(small, big[:m]), f"rows of the {m}-row call differ from the 300-row call's"


def test_the_epilogue_captures_into_a_cuda_graph(kern):
    mm, _ = kern
    m, hq, hkv, d, k = 64, 14, 2, 64, 896
    x, w, b, cos, sin, cache, slots = _case(m, hq, hkv, d, k, True)
    wi, bi = interleave_head_halves(w, d), interleave_head_halves(b, d)
    planner = mm.MatmulPlanner()
    kc, vc = cache.clone(), cache.clone()
    store = RopeStore(cos, sin, kc, vc, slots, hq, hkv, d)
    eager = mm.bi_linear(x, wi, bi, planner=planner, rope=store).clone()
    eager_k, eager_v = kc.clone(), vc.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mm.bi_linear(x, wi, bi, planner=planner, rope=store)
    kc.copy_(cache)
    vc.copy_(cache)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(kc, eager_k) and torch.equal(vc, eager_v)
    assert not torch.equal(kc, cache)
