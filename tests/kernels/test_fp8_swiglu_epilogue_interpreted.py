"""The rowwise FP8 GEMM's SWIGLU epilogue under Triton's interpreter (a subprocess with TRITON_INTERPRET=1,
started by tests/kernels/test_fp8_rowwise_cpu.py), tiny shapes: over a gate_up weight in
`interleave_gate_up`'s row order it gives, bit for bit, kernels/activation.silu_and_mul of the plain GEMM
over the [gate | up] weight — pointer and TMA loads, ragged M / I, a K tail, the persistent loop, three
output dtypes — and `fp8_rowwise_swiglu_quantized` keeps that with the M-bucket planner."""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine.models.quant.fp8_tensor import interleave_gate_up

from tests.support.interpreted import interpreted_kernels, skip_unless_interpreting

skip_unless_interpreting("tests/kernels/test_fp8_rowwise_cpu.py")


@pytest.fixture(scope="module")
def rw():
    mod = interpreted_kernels("fp8_rowwise", "_rowwise_gemm_kernel")
    interpreted_kernels("fp8_rowwise_tma", "_rowwise_tma_kernel")
    interpreted_kernels("activation", "_silu_and_mul_kernel")
    return mod


def _cfg(bm: int, bn: int, bk: int = 32, **extra: int) -> dict[str, int]:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 2, "num_warps": 4, "num_stages": 2,
            "IMPRECISE_ACC": 0, **extra}


def _operands(m: int, i: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(2 * i, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(2 * i, 1, generator=gen) * 1e-3 + 1e-4
    x = torch.randn(m, k, generator=gen) * 3
    x[0] = 0.0
    return x, w, s


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


SHAPES = [
    (37, 20, 80, _cfg(16, 16)),                  # ragged M and I (the last tile half outside), K tail
    (5, 16, 64, _cfg(16, 32, PERSISTENT=1)),     # fewer rows than a tile
    (70, 24, 48, _cfg(32, 16, PERSISTENT=1)),    # the persistent loop over several tiles
]


@pytest.mark.parametrize("m,i,k,cfg", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_swiglu_epilogue_is_the_gemm_then_silu_and_mul_bitwise(rw, m, i, k, cfg, dtype):
    from deepinfer.kernels.activation import silu_and_mul
    from deepinfer.kernels.fp8_rowwise_tma import rowwise_tma_launch

    x, w, s = _operands(m, i, k, seed=m + i + k)
    xq, xs = rw.quantize_rows(x)
    unfused = silu_and_mul(rw.rowwise_matmul(xq, xs, w, s, None, dtype, cfg))
    wi, si = interleave_gate_up(w, s)
    pointer = rw.rowwise_matmul(xq, xs, wi, si, None, dtype, cfg, swiglu=True)
    tma = rowwise_tma_launch(xq, xs, wi, si, None, torch.empty(m, i, dtype=dtype), {**cfg, "TMA": 1},
                             swiglu=True)
    assert pointer.shape == unfused.shape == (m, i)
    assert torch.equal(_bits(pointer), _bits(unfused))
    assert torch.equal(_bits(tma), _bits(unfused))


def test_swiglu_linear_with_the_planner_keeps_the_unfused_bits_across_m(rw, monkeypatch):
    from deepinfer.kernels.activation import silu_and_mul

    small, large = _cfg(16, 16, TMA=1), {**_cfg(16, 16, TMA=1, PERSISTENT=1), "num_stages": 3}
    monkeypatch.setattr(rw, "rowwise_buckets", lambda n, k: ((16, small), (None, large)))
    x, w, s = _operands(40, 24, 96, seed=5)
    wi, si = interleave_gate_up(w, s)
    planner = rw.RowwisePlanner()
    xq, xs = rw.quantize_rows(x)
    full = rw.fp8_rowwise_swiglu_quantized(xq, xs, wi, si, out_dtype=torch.float32, planner=planner)
    # The reference takes its tiles from the same planner (the interpreter's dot is numpy's, whose sums may
    # depend on the tile shape; tests/kernels/test_fp8_rowwise_tma_interpreted.py says more).
    plain = rw.fp8_rowwise_linear_quantized(xq, xs, w, s, out_dtype=torch.float32, planner=planner)
    ref = silu_and_mul(plain)
    assert torch.equal(full, ref)
    assert planner.verdicts() == {"48x96 float32 cpu": True}
    for rows in (1, 7, 16, 17):
        part = rw.fp8_rowwise_swiglu_quantized(xq[:rows], xs[:rows], wi, si, out_dtype=torch.float32,
                                               planner=planner)
        assert torch.equal(part, full[:rows])
