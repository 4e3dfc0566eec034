"""CpuFastOps: the plain GEMM / decode-chunk forms switch at DECODE_CHUNK_ROWS without changing what is
computed, and the pieces fast mode shares with deterministic mode (attention, rotary + store, SiLU-and-mul)
are the deterministic backend's own."""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine.layers.backends import make_ops
from deepinfer.engine.layers.cpu_ops import DECODE_CHUNK_ROWS, CpuFastOps, CpuInvariantOps
from deepinfer.kernels.reference.matmul import bi_linear_ref

FAST = make_ops("cpu", deterministic=False)
LO, HI = DECODE_CHUNK_ROWS
ROWS = [1, LO - 1, LO, 16, HI, HI + 1, 300]


def test_make_ops_gives_the_fast_backend_when_not_deterministic():
    assert isinstance(FAST, CpuFastOps) and not FAST.deterministic


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_linear_matches_the_float64_reference_on_both_sides_of_the_chunk_range(rows, bias, dtype, tol):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    w = torch.randn(200, 96, generator=gen).to(dtype)
    b = torch.randn(200, generator=gen).to(dtype) if bias else None
    got = FAST.linear(x, w, b)
    want = bi_linear_ref(x, w, b)
    assert got.shape == (rows, 200) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("rows", [r for r in ROWS if LO <= r <= HI])
def test_decode_sized_linear_rows_are_the_deterministic_rows(rows):
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(rows, 64, generator=gen), torch.randn(48, 64, generator=gen)
    assert torch.equal(FAST.linear(x, w), CpuInvariantOps().linear(x, w))


@pytest.mark.parametrize("method", ["attention", "attention_fp8", "rotary_store_kv", "silu_and_mul"])
def test_fast_mode_shares_the_deterministic_forms(method):
    assert getattr(CpuFastOps, method) is getattr(CpuInvariantOps, method)
