"""The fused rotary + KV-store kernel's FP8 (e4m3) form on CPU under Triton's interpreter, tiny shapes:
bitwise against the unfused composition (rotary, then the Triton store_kv_fp8) and its plain-torch reference
kernels/reference/rotary_store.py's `rotary_store_kv_fp8_ref`, in float32, bfloat16 and float16.

Runs only in a process started with TRITON_INTERPRET=1 (tests/kernels/test_rotary_store_fp8_cpu.py starts
one). bf16/fp16 tests patch the interpreter to round float32 casts as the GPU does
(tests/kernels/interpreter_bf16.py).
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.kernels.reference.kv_fp8 import quantize_kv_ref
from deepinfer.kernels.reference.rotary_store import rotary_store_kv_fp8_ref, rotate_half_ref

from tests.kernels.interpreter_bf16 import gpu_like_bf16
from tests.kernels.test_rotary_store_fp8_cpu import bf16_cache_case, bits, fresh_fp8_caches, make_fp8_case
from tests.support.interpreted import interpreted_kernels, skip_unless_interpreting

skip_unless_interpreting("tests/kernels/test_rotary_store_fp8_cpu.py")


@pytest.fixture(scope="module")
def rs():
    return interpreted_kernels("rotary_store", "_rotary_store_kv_kernel")


@pytest.fixture(scope="module")
def kv8():
    return interpreted_kernels("kv_fp8", "_store_kv_fp8_kernel")


def _unfused(kv8, c: dict) -> torch.Tensor:
    """What the attention layer ran before the fused op: rotate q, rotate k, then the Triton store."""
    cos, sin = c["cos"][:, None], c["sin"][:, None]
    q, k = rotate_half_ref(c["q"], cos, sin), rotate_half_ref(c["k"], cos, sin)
    kv8.store_kv_fp8(k, c["v"], c["k_cache"], c["v_cache"], c["slot_mapping"], c["k_scale"], c["v_scale"])
    return q


def _check(rs, kv8, case: dict) -> None:
    """Fused kernel, unfused composition and reference, each on its own caches: all bitwise equal; the q
    and the (quantized) rotated k also bitwise those of the bf16-cache fused path."""
    fused, unfused, ref = fresh_fp8_caches(case), fresh_fp8_caches(case), fresh_fp8_caches(case)
    q_fused = rs.rotary_store_kv(**fused)
    q_unfused = _unfused(kv8, unfused)
    q_ref = rotary_store_kv_fp8_ref(**ref)
    assert q_fused.is_contiguous() and q_fused.dtype == case["q"].dtype
    for name, q in (("unfused", q_unfused), ("reference", q_ref)):
        assert torch.equal(q_fused, q), f"q vs {name}: {(q_fused != q).sum().item()} elements differ"
    for name, other in (("unfused", unfused), ("reference", ref)):
        for cache in ("k_cache", "v_cache"):
            diff = (bits(fused[cache]) != bits(other[cache])).sum().item()
            assert diff == 0, f"{cache} vs {name}: {diff} bytes differ"
    plain = bf16_cache_case(case)
    assert torch.equal(q_fused, rs.rotary_store_kv(**plain))
    slots = case["slot_mapping"][case["slot_mapping"] >= 0].long()
    bs = case["k_cache"].shape[1]
    rotated_k = plain["k_cache"][slots // bs, slots % bs]
    assert torch.equal(bits(fused["k_cache"][slots // bs, slots % bs]),
                       bits(quantize_kv_ref(rotated_k, case["k_scale"])))


# (Hq, Hkv, D): MHA; GQA; MQA with a half (12) below the 16-wide tile; q heads over two programs with a
# ragged tail (head_dim 128 puts 8 heads in a program) and 6 kv heads (a non-power-of-two head block);
# the Qwen2.5-0.5B head layout.
HEADS = [(4, 4, 16), (8, 2, 32), (6, 1, 24), (12, 6, 128), (14, 2, 64)]


@pytest.mark.parametrize("hq,hkv,d", HEADS)
def test_kernel_matches_unfused_fp32(rs, kv8, hq, hkv, d):
    _check(rs, kv8, make_fp8_case(7, hq, hkv, d, dtype=torch.float32, seed=hq + d, padded=(2, 5)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("hq,hkv,d,block_size", [(8, 2, 32, 4), (12, 6, 128, 16), (14, 2, 64, 8),
                                                 (6, 1, 24, 1)])
def test_kernel_matches_unfused_half_precision(rs, kv8, monkeypatch, dtype, hq, hkv, d, block_size):
    gpu_like_bf16(monkeypatch)
    _check(rs, kv8, make_fp8_case(6, hq, hkv, d, dtype=dtype, seed=d, padded=(0,), block_size=block_size))


def test_clamped_and_subnormal_values_match(rs, kv8, monkeypatch):
    # Large activations against small scales (the +-448 clamp) and small ones against large scales
    # (e4m3 subnormals), on every head: the case mixes both (test_case_reaches_the_clamp_and_the_subnormals).
    gpu_like_bf16(monkeypatch)
    case = make_fp8_case(9, 4, 6, 32, dtype=torch.bfloat16, seed=3, padded=(4,), block_size=2)
    case["k"].mul_(8)
    _check(rs, kv8, case)


def test_all_padding_and_empty_steps(rs, kv8):
    case = make_fp8_case(3, 4, 2, 16, dtype=torch.float32, seed=5, padded=(0, 1, 2))
    _check(rs, kv8, case)
    own = fresh_fp8_caches(case)
    out = rs.rotary_store_kv(**own)   # q is still rotated; the caches stay as they were
    assert out.shape == case["q"].shape and not torch.equal(out, case["q"])
    assert torch.equal(bits(own["k_cache"]), bits(case["k_cache"]))
    assert torch.equal(bits(own["v_cache"]), bits(case["v_cache"]))
    empty = make_fp8_case(0, 4, 2, 16, dtype=torch.float32)
    assert rs.rotary_store_kv(**empty).shape == (0, 4, 16)


def test_scales_required_exactly_for_an_fp8_cache(rs):
    case = make_fp8_case(3, 4, 2, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="needs its float32 per-kv-head scales"):
        rs.rotary_store_kv(**{**case, "v_scale": None})
    with pytest.raises(ValueError, match="only an e4m3 cache takes scales"):
        rs.rotary_store_kv(**{**bf16_cache_case(case), "k_scale": case["k_scale"]})
    with pytest.raises(ValueError, match="k_scale: 1 scales for 2 kv heads"):
        rs.rotary_store_kv(**{**case, "k_scale": case["k_scale"][:1]})


def test_token_bits_do_not_depend_on_the_batch(rs, monkeypatch):
    gpu_like_bf16(monkeypatch)
    case = make_fp8_case(8, 8, 2, 32, dtype=torch.bfloat16, seed=6, padded=(4,))
    full = fresh_fp8_caches(case)
    q_full = rs.rotary_store_kv(**full)
    bs = case["k_cache"].shape[1]
    names = ("q", "k", "v", "cos", "sin", "slot_mapping")
    for lo, hi in [(0, 1), (3, 6), (7, 8)]:
        part = fresh_fp8_caches({**case, **{n: case[n][lo:hi] for n in names}})
        assert torch.equal(rs.rotary_store_kv(**part), q_full[lo:hi])
        for slot in case["slot_mapping"][lo:hi].tolist():
            if slot >= 0:
                blk, off = slot // bs, slot % bs
                assert torch.equal(bits(part["k_cache"][blk, off]), bits(full["k_cache"][blk, off]))
                assert torch.equal(bits(part["v_cache"][blk, off]), bits(full["v_cache"][blk, off]))


def test_cuda_backend_dispatch_and_disable_switch(rs, kv8, monkeypatch):
    # The CUDA backend's op under the interpreter (CPU tensors): the fused kernel by default, rotary then the
    # Triton store_kv_fp8 with DEEPINFER_DISABLE_FUSED_ROPE=1; both give the reference's bits.
    from deepinfer.engine.layers import cuda_ops

    calls = {"fused": 0, "store": 0}
    kernel, store = rs.rotary_store_kv, kv8.store_kv_fp8

    def count(key, fn):
        def wrapped(*a):
            calls[key] += 1
            return fn(*a)
        return wrapped

    monkeypatch.setattr(rs, "rotary_store_kv", count("fused", kernel))
    monkeypatch.setattr(kv8, "store_kv_fp8", count("store", store))
    case = make_fp8_case(5, 4, 2, 16, dtype=torch.float32, seed=7, padded=(1,))
    want = fresh_fp8_caches(case)
    q_ref = rotary_store_kv_fp8_ref(**want)
    for disabled, launches in [("", {"fused": 1, "store": 0}), ("1", {"fused": 0, "store": 1})]:
        monkeypatch.setenv(cuda_ops.DISABLE_FUSED_ROPE_ENV, disabled)
        calls.update(fused=0, store=0)
        ops = cuda_ops.CudaInvariantOps()
        assert ops.fused_rope is (disabled != "1")
        got = fresh_fp8_caches(case)
        q_rot = ops.rotary_store_kv_fp8(got["q"], got["k"], got["v"], got["cos"][:, None],
                                        got["sin"][:, None], got["k_cache"], got["v_cache"],
                                        got["slot_mapping"], got["k_scale"], got["v_scale"])
        assert calls == launches
        assert torch.equal(q_rot, q_ref)
        assert torch.equal(bits(got["k_cache"]), bits(want["k_cache"]))
        assert torch.equal(bits(got["v_cache"]), bits(want["v_cache"]))
