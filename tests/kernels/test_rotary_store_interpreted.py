"""The fused rotary + KV-store kernel on CPU under Triton's interpreter, tiny shapes, against
kernels/reference/rotary_store.py: bitwise, in float32, bfloat16 and float16.

Runs only in a process started with TRITON_INTERPRET=1 (tests/kernels/test_rotary_store_cpu.py starts one).
bf16/fp16 tests patch the interpreter to round float32 casts to nearest even as the GPU does
(tests/kernels/interpreter_bf16.py); without that it truncates and no bitwise comparison would mean anything.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.kernels.reference.rotary_store import rotary_store_kv_ref

from tests.kernels.interpreter_bf16 import gpu_like_bf16
from tests.kernels.test_rotary_store_cpu import fresh_caches, make_case
from tests.support.interpreted import interpreted_kernels, skip_unless_interpreting

skip_unless_interpreting("tests/kernels/test_rotary_store_cpu.py")


@pytest.fixture(scope="module")
def rs():
    return interpreted_kernels("rotary_store", "_rotary_store_kv_kernel")


def _check(rs, case: dict) -> None:
    """Kernel and reference, each on its own copy of the caches: rotated q and both caches bitwise equal."""
    got, want = fresh_caches(case), fresh_caches(case)
    q_rot = rs.rotary_store_kv(**got)
    q_ref = rotary_store_kv_ref(**want)
    assert q_rot.is_contiguous() and q_rot.dtype == q_ref.dtype
    assert torch.equal(q_rot, q_ref), f"q: {(q_rot != q_ref).sum().item()} elements differ"
    assert torch.equal(got["k_cache"], want["k_cache"]), "k_cache differs"
    assert torch.equal(got["v_cache"], want["v_cache"]), "v_cache differs"


# (Hq, Hkv, D): MHA; GQA; MQA with a half (12) below the 16-wide tile; q heads over two programs
# (head_dim 128 puts 8 heads in a program) with a ragged tail; the Qwen2.5-0.5B head layout.
HEADS = [(4, 4, 16), (8, 2, 32), (6, 1, 24), (12, 4, 128), (14, 2, 64)]


@pytest.mark.parametrize("hq,hkv,d", HEADS)
def test_kernel_matches_reference_fp32(rs, hq, hkv, d):
    _check(rs, make_case(7, hq, hkv, d, dtype=torch.float32, seed=hq + d, padded=(2, 5)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("hq,hkv,d", [HEADS[1], HEADS[3], HEADS[4]])
def test_kernel_matches_reference_half_precision(rs, monkeypatch, dtype, hq, hkv, d):
    gpu_like_bf16(monkeypatch)
    _check(rs, make_case(6, hq, hkv, d, dtype=dtype, seed=d, padded=(0,), block_size=8))


def test_all_padding_and_empty_steps(rs):
    case = make_case(3, 4, 2, 16, dtype=torch.float32, seed=5, padded=(0, 1, 2))
    _check(rs, case)
    own = fresh_caches(case)
    out = rs.rotary_store_kv(**own)   # q is still rotated; the caches stay as they were
    assert out.shape == case["q"].shape and not torch.equal(out, case["q"])
    assert torch.equal(own["k_cache"], case["k_cache"]) and torch.equal(own["v_cache"], case["v_cache"])
    empty = make_case(0, 4, 2, 16, dtype=torch.float32)
    assert rs.rotary_store_kv(**empty).shape == (0, 4, 16)


def test_token_bits_do_not_depend_on_the_batch(rs, monkeypatch):
    gpu_like_bf16(monkeypatch)
    case = make_case(8, 8, 2, 32, dtype=torch.bfloat16, seed=6, padded=(4,))
    full = fresh_caches(case)
    q_full = rs.rotary_store_kv(**full)
    for lo, hi in [(0, 1), (3, 6), (7, 8)]:
        part = fresh_caches({**case, **{n: case[n][lo:hi] for n in ("q", "k", "v", "cos", "sin",
                                                                      "slot_mapping")}})
        assert torch.equal(rs.rotary_store_kv(**part), q_full[lo:hi])
        bs = case["k_cache"].shape[1]
        for slot in case["slot_mapping"][lo:hi].tolist():
            if slot >= 0:
                blk, off = slot // bs, slot % bs
                assert torch.equal(part["k_cache"][blk, off], full["k_cache"][blk, off])
                assert torch.equal(part["v_cache"][blk, off], full["v_cache"][blk, off])


def test_cuda_backend_dispatch_and_disable_switch(rs, monkeypatch):
    # The CUDA backend's op under the interpreter (CPU tensors): the fused kernel by default, the unfused
    # composition (Triton store_kv) with DEEPINFER_DISABLE_FUSED_ROPE=1; both give the reference's bits.
    from deepinfer.engine.layers import cuda_ops

    calls = []
    kernel = rs.rotary_store_kv
    monkeypatch.setattr(rs, "rotary_store_kv", lambda *a: calls.append(1) or kernel(*a))
    case = make_case(5, 4, 2, 16, dtype=torch.float32, seed=7, padded=(1,))
    want = fresh_caches(case)
    q_ref = rotary_store_kv_ref(**want)
    for disabled, fused_calls in [("", 1), ("1", 0)]:
        monkeypatch.setenv(cuda_ops.DISABLE_FUSED_ROPE_ENV, disabled)
        calls.clear()
        ops = cuda_ops.CudaInvariantOps()
        assert ops.fused_rope is (disabled != "1")
        got = fresh_caches(case)
        q_rot = ops.rotary_store_kv(got["q"], got["k"], got["v"], got["cos"][:, None], got["sin"][:, None],
                                    got["k_cache"], got["v_cache"], got["slot_mapping"])
        assert len(calls) == fused_calls
        assert torch.equal(q_rot, q_ref)
        assert torch.equal(got["k_cache"], want["k_cache"]) and torch.equal(got["v_cache"], want["v_cache"])
