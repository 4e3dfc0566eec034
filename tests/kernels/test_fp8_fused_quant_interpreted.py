"""The row quantizer and the fused RMSNorm / SiLU-and-mul -> FP8 kernels under Triton's interpreter (a
subprocess with TRITON_INTERPRET=1, started by tests/kernels/test_fp8_fused_quant_cpu.py), tiny shapes.

Bitwise: `quantize_rows` (register-resident, two-pass and column-split) against `quantize_act_ref`, and
each fused kernel against the unfused kernels it replaces (rmsnorm.rms_norm / activation.silu_and_mul,
then quantize_rows).
Against the plain-torch references (kernels/reference/fp8_fused_quant.py): the same scales and e4m3 codes
at most one grid step apart (the norm's sum and the exp are not torch's bit for bit on the host).
"""

from __future__ import annotations

import pytest
import torch
from deepinfer.kernels.reference.fp8_fused_quant import (
    quantize_rows_ref,
    rms_norm_quant_ref,
    silu_and_mul_quant_ref,
)

from tests.kernels.interpreter_bf16 import float32_or_gpu_bf16
from tests.support.interpreted import interpreted_kernels, skip_unless_interpreting

skip_unless_interpreting("tests/kernels/test_fp8_fused_quant_cpu.py")


@pytest.fixture(scope="module")
def km():
    return {name: interpreted_kernels(name) for name in ("fp8_row_quant", "fp8_fused_quant", "rmsnorm",
                                                         "activation", "fp8_rowwise", "fp8_split_quant")}


dtype = float32_or_gpu_bf16   # the tests' `dtype` fixture: float32, and bfloat16 with the GPU's roundings


def _x(m: int, k: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows that cover the quantizer's corners: zeros, values at e4m3's range edge, tiny and huge rows."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * 3
    x[0] = 0.0                                    # all zeros: scale EPS / 448, quantizes to zeros
    if m > 1:
        x[1] = 447.9                              # one value everywhere: every quotient lands on 448
    if m > 2:
        x[2, : k // 2] *= 1e-4                    # e4m3 subnormals beside the row's max
        x[2, -1] = 3e4
    if m > 3:
        x[3] *= 1e-20                             # below EPS: the clamped scale
    return x.to(dtype)


def _same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))


def _near(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=0.0)
    a, b = got[0].view(torch.uint8).int(), want[0].view(torch.uint8).int()
    # Magnitudes at most one code apart (e4m3 codes are monotonic in the magnitude), the same sign but
    # where both are within a step of zero.
    mag_a, mag_b = a & 0x7F, b & 0x7F
    assert int((mag_a - mag_b).abs().max()) <= 1
    assert bool((((a & 0x80) == (b & 0x80)) | ((mag_a <= 1) & (mag_b <= 1))).all())
    assert float((a != b).float().mean()) < 0.05


# split: None = the automatic path (the column-split kernels at these sizes), 0 = the one-program kernel,
# N = the split kernels with N columns per program (kernels/fp8_split_quant.py).
@pytest.mark.parametrize("m,k,chunk,split", [(1, 1, None, None), (5, 40, None, None), (300, 24, None, 0),
                                             (6, 100, 32, None), (4, 64, 64, None), (9, 520, None, 0),
                                             (9, 520, None, 64), (3, 33, 16, None), (5, 40, None, 16)])
def test_quantize_rows_bitwise_reference(km, dtype, m, k, chunk, split):
    x = _x(m, k, seed=k, dtype=dtype)
    _same(km["fp8_row_quant"].quantize_rows(x, chunk=chunk, split=split), quantize_rows_ref(x))


def test_split_path_is_chosen_by_input_size(km):
    sq = km["fp8_split_quant"]
    small = torch.empty(256, 2 * 14336, dtype=torch.bfloat16, device="meta")   # a decode step's gate|up
    large = torch.empty(2048, 2 * 14336, dtype=torch.bfloat16, device="meta")  # a prefill chunk's
    assert sq.use_split(small) and not sq.use_split(large) and sq.use_split(large, 1024)
    with pytest.raises(ValueError, match="power of two"):
        km["fp8_row_quant"].quantize_rows(_x(2, 40, seed=1), split=48)


def test_row_launch_shapes_and_errors(km):
    rq = km["fp8_row_quant"]
    assert rq.row_launch(14336) == {"ROWS": 1, "BLOCK": 16384, "RESIDENT": True, "num_warps": 16}
    assert rq.row_launch(4096)["RESIDENT"] and rq.row_launch(100)["ROWS"] == 16
    assert not rq.row_launch(rq.RESIDENT_MAX + 1)["RESIDENT"]
    with pytest.raises(ValueError, match="power of two"):
        rq.row_launch(64, chunk=48)


@pytest.mark.parametrize("h", [1, 48, 100, 256, 300])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_quant_is_unfused_kernels_bitwise(km, dtype, h, with_residual):
    x = _x(6, h, seed=h, dtype=dtype)
    w = (1 + 0.1 * torch.randn(h, generator=torch.Generator().manual_seed(1))).to(dtype)
    r = _x(6, h, seed=h + 1, dtype=dtype).flip(0).contiguous() if with_residual else None
    q, s, res = km["fp8_fused_quant"].rms_norm_quant(x, w, 1e-5, residual=r)
    if with_residual:
        out, summed = km["rmsnorm"].rms_norm(x, w, 1e-5, residual=r)
        assert torch.equal(res, summed)
    else:
        out = km["rmsnorm"].rms_norm(x, w, 1e-5)
        assert res is None
    _same((q, s), km["fp8_row_quant"].quantize_rows(out))
    if dtype == torch.float32:
        q_ref, s_ref, res_ref = rms_norm_quant_ref(x, w, 1e-5, r)
        _near((q, s), (q_ref, s_ref))
        assert res_ref is None or torch.equal(res, res_ref)


def test_rms_norm_quant_wide_rows_run_the_unfused_composition(km):
    fq = km["fp8_fused_quant"]
    h = 2 * fq.FUSED_NORM_MAX + 8     # also past rmsnorm.py's widest chunk: its two-pass path
    x, r = _x(2, h, seed=3), _x(2, h, seed=4)
    w = torch.rand(h, generator=torch.Generator().manual_seed(5)) + 0.5
    q, s, res = fq.rms_norm_quant(x, w, 1e-6, residual=r)
    out, summed = km["rmsnorm"].rms_norm(x, w, 1e-6, residual=r)
    _same((q, s), km["fp8_row_quant"].quantize_rows(out))
    assert torch.equal(res, summed)


@pytest.mark.parametrize("i,chunk,split", [(1, None, None), (36, None, None), (100, 32, None),
                                           (257, None, None), (64, 16, None), (257, None, 0), (257, None, 32),
                                           (100, None, 16)])
def test_silu_and_mul_quant_is_unfused_kernels_bitwise(km, dtype, i, chunk, split):
    x = torch.cat([_x(7, i, seed=i, dtype=dtype), _x(7, i, seed=i + 9, dtype=dtype) * 0.1], dim=1)
    x[4, :i] = 60.0        # silu(60) = 60: the row max meets the e4m3 range edge through the product
    got = km["fp8_fused_quant"].silu_and_mul_quant(x, chunk=chunk, split=split)
    _same(got, km["fp8_row_quant"].quantize_rows(km["activation"].silu_and_mul(x), split=0))
    if dtype == torch.float32:
        _near(got, silu_and_mul_quant_ref(x))


def test_fused_rows_do_not_depend_on_the_batch(km):
    fq = km["fp8_fused_quant"]
    x, r = _x(40, 72, seed=11), _x(40, 72, seed=12)
    w = torch.rand(72, generator=torch.Generator().manual_seed(13)) + 0.5
    full = fq.rms_norm_quant(x, w, 1e-5, residual=r)
    g = torch.cat([x, r], dim=1)
    full_act = fq.silu_and_mul_quant(g)
    for lo, hi in ((0, 1), (17, 18), (3, 40)):
        part = fq.rms_norm_quant(x[lo:hi].clone(), w, 1e-5, residual=r[lo:hi].clone())
        _same(part[:2], (full[0][lo:hi], full[1][lo:hi]))
        _same(fq.silu_and_mul_quant(g[lo:hi].clone()), (full_act[0][lo:hi], full_act[1][lo:hi]))


def test_rowwise_linear_on_quantized_rows_is_the_quantizing_linear(km):
    rw = km["fp8_rowwise"]
    gen = torch.Generator().manual_seed(14)
    w = (torch.randn(24, 48, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    ws = torch.rand(24, 1, generator=gen) * 1e-3 + 1e-4
    x = _x(9, 48, seed=15)
    b = torch.randn(24, generator=gen)
    xq, xs = rw.quantize_rows(x)
    got = rw.fp8_rowwise_linear_quantized(xq, xs, w, ws, b, out_dtype=x.dtype)
    assert torch.equal(got, rw.fp8_rowwise_linear(x, w, ws, b))
    with pytest.raises(ValueError, match="one scale per row"):
        rw.fp8_rowwise_linear_quantized(xq, xs.expand(9, 2), w, ws, out_dtype=x.dtype)
    with pytest.raises(ValueError, match="xq"):
        rw.fp8_rowwise_linear_quantized(x, xs, w, ws, out_dtype=x.dtype)
