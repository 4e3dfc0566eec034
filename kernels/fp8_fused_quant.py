"""The rowwise FP8 GEMM's activation quantization fused into the op that produces the activation.

Each kernel returns what `quantize_rows` (kernels/fp8_row_quant.py) would give on the op's bf16 output,
bit for bit, without writing that output: e4m3 rows [M, K] and float32 row scales [M, 1].

- `rms_norm_quant`: (residual add +) RMSNorm, as kernels/rmsnorm.py computes it (same steps, same
  roundings, the sum of squares reduced in the same layout), the output rounded to the input dtype, then
  the row max of that ROUNDED output, the scale and the e4m3 cast. Feeds qkv_proj and gate_up_proj.
- `silu_and_mul_quant`: silu(gate) * up as kernels/activation.py computes it (silu in fp32 rounded to the
  input dtype, the product rounded once), then the same quantization. Feeds down_proj (K = 14,336 on
  Llama-3.1-8B).

Row-local math only, one program per row (or a few short rows): a row's bits never depend on the other
rows of the call, so both are batch-invariant by construction. Decode-sized inputs of `silu_and_mul_quant`
run kernels/fp8_split_quant.py instead (a row's columns over several programs, the same bits).

Why the RMSNorm path needs care: the row max and the cast are order-free, but the sum of squares is a
float reduction, whose bits follow (1) the register layout Triton gives the row and (2) which products the
compiler contracts into the adds as FMAs. (2): with contraction on, LLVM fused some squares and not
others, differently in two kernels sharing these lines (seen in the sm_90 PTX); so both this kernel and
rmsnorm.py launch with `enable_fp_fusion=False`, and the sum is exactly the source's products and adds.
(1): Triton's coalescing pass gives every memory op of a kernel the widest vector any of them wants, capped
at elements / threads; an e4m3 store wants 16 elements per thread, a bf16 load 8. With rmsnorm.py's launch
(BLOCK = next_pow2(H), BLOCK // 256 warps for BLOCK >= 256, one warp below) the cap is 8 elements per
thread (BLOCK / 32 below 256) whenever BLOCK <= 4,096, so the rows are laid out, and summed, as in
rmsnorm.py: the sm_90 PTX of both kernels computes rstd by the same expression tree, H = 100 ... 4,096,
with and without residual (tests/kernels/test_fp8_fused_quant_ptx.py, on the CPU). Wider rows (BLOCK
8,192: cap 16) would be summed in another order, so `rms_norm_quant` runs the unfused composition there
(`FUSED_NORM_MAX`). tests/kernels/test_fp8_fused_quant_gpu.py checks the bits on the device.

SiLU-and-mul, on paper (I = 14,336, bf16): holding the row in registers costs one read of gate and up
(4I bytes) and one e4m3 write (I bytes), 16,384 fp32 values per program (32 per thread at 16 warps);
recomputing it costs a second read of 4I bytes (from L2 at best: 57 KB per row, ~30 MB for the rows in
flight on 132 SMs, most of the 50 MB L2) and a second exp per element, and serialises two dependent load
passes. So rows up to `RESIDENT_MAX` columns (64 values per thread) stay in registers; longer rows take
the two-pass recompute (max, then cast) over chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels._checks import check_tensor
from deepinfer.kernels.e4m3 import e4m3_quotient
from deepinfer.kernels.fp8_row_quant import row_launch, row_scale
from deepinfer.kernels.fp8_split_quant import split_quant, swiglu_values, use_split
from deepinfer.kernels.reference.fp8_matmul import ACT_EPS, FP8_DTYPE, FP8_MAX
from deepinfer.kernels.rmsnorm import check_rms_norm_args, rms_norm, rms_norm_row

__all__ = ["rms_norm_quant", "silu_and_mul_quant", "FUSED_NORM_MAX"]

# Widest row (next power of two of H) the fused RMSNorm covers bitwise (see the module docstring).
FUSED_NORM_MAX = 4096


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr,
    H, eps,
    stride_x, stride_r, stride_q, stride_res_out,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, EPS: tl.constexpr, QMAX: tl.constexpr,
    HW: tl.constexpr,
):
    # kernels/rmsnorm.py's SINGLE_CHUNK path, its own helper (same argument kinds: H and eps are runtime
    # arguments there too).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    res_row = res_out_ptr + row * stride_res_out
    y, mask = rms_norm_row(x_row, r_row, w_ptr, res_row, offs, H, eps, HAS_RESIDUAL, 0, x_row, 0, False)
    # The norm's output as rmsnorm.py stores it (rounded to the input dtype), then quantize_rows' steps.
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    scale = row_scale(tl.max(tl.abs(y), axis=0), EPS, QMAX)
    q = e4m3_quotient(y, scale, QMAX, HW)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=mask)
    tl.store(s_ptr + row, scale)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """RMSNorm of x [M, H] (+ residual [M, H] first) quantized per row: (e4m3 [M, H], float32 scales
    [M, 1], the new residual h = x + residual or None without one). Bitwise
    `quantize_rows(rms_norm(x, weight, eps[, residual]))` (kernels/rmsnorm.py); rows wider than
    FUSED_NORM_MAX run exactly that composition. Inputs are not modified."""
    m, h = check_rms_norm_args(x, weight, eps, residual)
    block = triton.next_power_of_2(max(h, 1))
    if block > FUSED_NORM_MAX:
        from deepinfer.kernels.fp8_row_quant import quantize_rows

        if residual is None:
            return (*quantize_rows(rms_norm(x, weight, eps)), None)
        out, res_out = rms_norm(x, weight, eps, residual=residual)
        return (*quantize_rows(out), res_out)
    q = torch.empty((m, h), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    res_out = torch.empty((m, h), dtype=x.dtype, device=x.device) if residual is not None else None
    if m > 0 and h > 0:
        _rms_norm_quant_kernel[(m,)](
            x, residual if residual is not None else x, weight, q, s, res_out if res_out is not None else x,
            h, float(eps),
            x.stride(0), residual.stride(0) if residual is not None else 0, q.stride(0),
            res_out.stride(0) if res_out is not None else 0,
            HAS_RESIDUAL=residual is not None, BLOCK=block, EPS=ACT_EPS, QMAX=FP8_MAX, HW=x.is_cuda,
            # rmsnorm.py's launch: its warps for this BLOCK (the same layout) and no FMA contraction.
            num_warps=max(1, min(16, block // 256)), enable_fp_fusion=False,
        )
    return q, s, res_out


@triton.jit(do_not_specialize=["M"])
def _silu_mul_quant_kernel(x_ptr, q_ptr, s_ptr, M, N_COLS, stride_x, stride_q, ROWS: tl.constexpr,
                           BLOCK: tl.constexpr, RESIDENT: tl.constexpr, EPS: tl.constexpr,
                           QMAX: tl.constexpr, HW: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    offs = tl.arange(0, BLOCK)
    x_rows = x_ptr + rows[:, None] * stride_x
    q_rows = q_ptr + rows[:, None] * stride_q
    if RESIDENT:   # BLOCK >= N_COLS: the row's product stays in registers between the max and the cast
        mask = row_ok[:, None] & (offs[None, :] < N_COLS)
        y = swiglu_values(x_rows, offs[None, :], mask, N_COLS)
        scale = row_scale(tl.max(tl.abs(y), axis=1), EPS, QMAX)
        q = e4m3_quotient(y, scale[:, None], QMAX, HW)
        tl.store(q_rows + offs[None, :], q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    else:          # two passes, the product recomputed (the same elementwise bits both times)
        amax = tl.zeros((ROWS,), dtype=tl.float32)
        for k0 in range(0, N_COLS, BLOCK):
            mask = row_ok[:, None] & (k0 + offs[None, :] < N_COLS)
            y = swiglu_values(x_rows, k0 + offs[None, :], mask, N_COLS)
            amax = tl.maximum(amax, tl.max(tl.abs(y), axis=1))
        scale = row_scale(amax, EPS, QMAX)
        for k0 in range(0, N_COLS, BLOCK):
            mask = row_ok[:, None] & (k0 + offs[None, :] < N_COLS)
            y = swiglu_values(x_rows, k0 + offs[None, :], mask, N_COLS)
            q = e4m3_quotient(y, scale[:, None], QMAX, HW)
            tl.store(q_rows + k0 + offs[None, :], q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                     mask=mask)
    tl.store(s_ptr + rows, scale, mask=row_ok)


def silu_and_mul_quant(x: torch.Tensor, *, chunk: int | None = None, split: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, 2I] = [gate | up] -> silu(gate) * up quantized per row: (e4m3 [M, I], float32 scales [M, 1]);
    bitwise `quantize_rows(silu_and_mul(x))` (kernels/activation.py). Inputs up to
    fp8_split_quant.SPLIT_MAX_BYTES (decode-sized M) run the column-split kernels
    (kernels/fp8_split_quant.py). Tests and benchmarks may force a path: `chunk` the one-program two-pass
    recompute with chunks of that many columns, `split=0` the one-program kernel, `split=N` the split
    kernels with N columns per program. The bits depend on none of these."""
    check_tensor("x", x, ndim=2)
    m, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"x: last dimension {two_i} must be even (gate and up halves)")
    i = two_i // 2
    q = torch.empty((m, i), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m and i and chunk is None and split != 0 and use_split(x, split):
        split_quant(x, q, s, i, swiglu=True, eps=ACT_EPS, qmax=FP8_MAX, block=split)
    elif m and i:
        cfg = row_launch(i, chunk)
        _silu_mul_quant_kernel[(triton.cdiv(m, cfg["ROWS"]),)](
            x, q, s, m, i, x.stride(0), q.stride(0), ROWS=cfg["ROWS"], BLOCK=cfg["BLOCK"],
            RESIDENT=cfg["RESIDENT"], EPS=ACT_EPS, QMAX=FP8_MAX, HW=x.is_cuda,
            num_warps=cfg["num_warps"])
    return q, s
