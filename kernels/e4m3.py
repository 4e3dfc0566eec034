"""The e4m3 quantization step every FP8 kernel here shares: clamp(x / scale) rounded to nearest-even on the
e4m3 grid, bitwise what torch gives for `(x / scale).clamp(-448, 448).to(torch.float8_e4m3fn)` (an IEEE
division, then the round-to-nearest-even cast).

Two forms of the same bits, picked by the constexpr `HW` (the launcher passes `x.is_cuda`):

- `HW=False` (Triton's CPU interpreter, which has neither a fused multiply-add nor a correct fp32 -> fp8
  cast): the quotient by `div_rn`, then `round_to_e4m3` puts it on the e4m3 grid by integer operations,
  so the cast that follows is exact.
- `HW=True` (the GPU): the quotient from one IEEE reciprocal per scale and two FMAs per element, the
  rounding left to the hardware cast (cvt.rn.satfinite.e4m3x2.f32, round-to-nearest-even). Markstein's
  theorem: with y = RN(1/d) and q0 = RN(x y) within one ulp of x/d, the remainder r = x - q0 d is exact in
  one FMA and RN(q0 + r y) = RN(x/d), for quotients in the normal range. Ours are at most 448 in magnitude;
  below the normal range (|x/d| < 2^-126) every candidate rounds to a signed zero in e4m3, and a zero q0
  is kept as it is so the zero's sign is the division's.

Why the GPU form: the SiLU-and-mul quantizer's sm_90 code (32 values per thread) shrinks from 1,688 to 968
instructions and from 83 to 63 registers, so two 16-warp programs fit an SM instead of one; on the H200 it
went from 764 to 331 us at M = 16,384 (from compute-bound to 3.5 TB/s), the other quantizers 1.2-2x
(benchmarks/e4m3_quant_timing.py; benchmarks/RESULTS.md, 2026-12-02 16:58 UTC), every output bitwise equal
to the interpreter form's and to torch's. tests/kernels/test_fp8_fused_quant_gpu.py compares every
quantizer's bits with torch on the device; tests/kernels/test_fp8_fused_quant_ptx.py checks on the CPU
that the GPU form compiles to FMAs, one division per scale and the hardware cast.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["round_to_e4m3", "e4m3_quotient"]


@triton.jit
def round_to_e4m3(v):
    """fp32 values within +-448 rounded to nearest-even on the e4m3 grid (still fp32), so the cast that
    follows is exact. Done by hand because Triton's CPU interpreter rounds fp32 -> fp8 without carrying into
    the exponent; on the GPU this equals cvt.rn (rtne)."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag = bits & 0x7FFFFFFF
    # Normal e4m3 (|v| >= 2^-6): keep 3 of fp32's 23 mantissa bits, ties to even; the add carries.
    normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & 0xFFF00000
    # Subnormal e4m3: multiples of 2^-9; x + 1.5 * 2^23 - 1.5 * 2^23 rounds x to an integer, ties to even.
    a = mag.to(tl.float32, bitcast=True)
    sub = (((a * 512.0 + 12582912.0) - 12582912.0) * 0.001953125).to(tl.uint32, bitcast=True)
    # The sign goes back on last, so -0.0 and tiny negatives keep it as torch's cast does.
    return (tl.where(a >= 0.015625, normal, sub) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _div_rn_fma(x, d):
    """RN(x / d) for d > 0 with x / d in fp32's normal range or a zero (module docstring); d may be a
    broadcast scale (one reciprocal per scale, not per element)."""
    y = tl.math.div_rn(d * 0.0 + 1.0, d)
    q0 = x * y
    r = tl.fma(-q0, d, x)
    return tl.where(q0 == 0.0, q0, tl.fma(r, y, q0))


@triton.jit
def e4m3_quotient(x, scale, QMAX: tl.constexpr, HW: tl.constexpr):
    """fp32 x over its (broadcast) positive scale, clamped to +-QMAX, ready for the rtne cast to e4m3: on the
    e4m3 grid already (HW False) or rounded by the cast itself (HW True); the same e4m3 bits either way."""
    if HW:
        return tl.minimum(tl.maximum(_div_rn_fma(x, scale), -QMAX), QMAX)
    # IEEE division (div_rn): Triton's `/` on fp32 is the approximate div.full on the GPU, whose last-ulp
    # error moves a quotient next to an e4m3 rounding boundary to the other side of it.
    return round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -QMAX), QMAX))
