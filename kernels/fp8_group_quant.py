"""The block-scaled FP8 GEMM's activation quantization (one scale per token and K-group) fused into the op
that produces the activation.

Each kernel returns what `quantize_act(y, group)` (kernels/fp8_matmul.py) gives on the op's output y, bit
for bit, without writing y: e4m3 rows [M, K] and float32 scales [M, ceil(K / group)], row-major (the
layout `quantize_act` returns and `block_matmul` reads).

- `rms_norm_group_quant`: (residual add +) RMSNorm as kernels/rmsnorm.py computes it, through the same
  jitted row helper and launch as the rowwise fused kernel (kernels/fp8_fused_quant.py, whose docstring
  says why the sum of squares then has rmsnorm.py's bits: same layout, no FMA contraction), the output
  rounded to the input dtype, then per group of GROUP columns its max |y|, the scale and the e4m3 cast.
  The row is regrouped [BLOCK] -> [BLOCK / GROUP, GROUP] only after rstd is computed, and the e4m3 codes
  are stored from the flat [BLOCK] view, so the loads and the sum keep the rowwise kernel's layout
  (tests/kernels/test_fp8_fused_quant_ptx.py compares the rstd expression tree in the sm_90 PTX with
  rmsnorm.py's). Rows wider than FUSED_NORM_MAX run the unfused composition. Feeds qkv_proj and
  gate_up_proj.
- `silu_and_mul_group_quant`: silu(gate) * up as kernels/activation.py rounds it (`swiglu_values`, the
  helper the rowwise fused kernels share), then the same per-group quantization. One program per ROWS rows
  x one K-group: a group's max needs only its own 128 columns, so unlike the rowwise form nothing is read
  twice and no cross-program step exists at any M. Feeds down_proj.

Group max and cast are `quantize_act`'s steps (`row_scale`: max(amax, EPS) / 448 by the constant;
`e4m3_quotient`: IEEE division, clamp, round to the e4m3 grid), and a max is exact in any order, so only
the producing op's arithmetic needs the care above. Row-local math only: batch-invariant by construction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels._checks import check_tensor, is_power_of_two
from deepinfer.kernels.e4m3 import e4m3_quotient
from deepinfer.kernels.fp8_fused_quant import FUSED_NORM_MAX
from deepinfer.kernels.fp8_matmul import quantize_act
from deepinfer.kernels.fp8_row_quant import row_scale
from deepinfer.kernels.fp8_split_quant import swiglu_values
from deepinfer.kernels.reference.fp8_matmul import ACT_EPS, FP8_DTYPE, FP8_MAX
from deepinfer.kernels.rmsnorm import check_rms_norm_args, rms_norm, rms_norm_row

__all__ = ["rms_norm_group_quant", "silu_and_mul_group_quant"]

# Rows per program of the SiLU-and-mul kernel: ROWS x GROUP values (2,048 at GROUP 128), 16 per thread at
# 4 warps, as kernels/fp8_matmul.py's quantize_act.
_ACT_ROWS = 16


@triton.jit
def _rms_norm_group_quant_kernel(
    x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr,
    H, eps,
    stride_x, stride_r, stride_q, stride_s, stride_res_out,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, EPS: tl.constexpr,
    QMAX: tl.constexpr, HW: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    y, mask = rms_norm_row(x_ptr + row * stride_x, r_ptr + row * stride_r, w_ptr,
                           res_out_ptr + row * stride_res_out, offs, H, eps, HAS_RESIDUAL, 0, x_ptr, 0,
                           False)
    # The norm's output as rmsnorm.py stores it (rounded to the input dtype); masked columns are 0, so a
    # partial last group's max is that of its real columns (quantize_act pads with zeros too).
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    groups = tl.reshape(y, (BLOCK // GROUP, GROUP))
    scale = row_scale(tl.max(tl.abs(groups), axis=1), EPS, QMAX)
    q = tl.reshape(e4m3_quotient(groups, scale[:, None], QMAX, HW), (BLOCK,))
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=mask)
    g = tl.arange(0, BLOCK // GROUP)
    tl.store(s_ptr + row * stride_s + g, scale, mask=g * GROUP < H)


def _check_group(group: int) -> None:
    if not is_power_of_two(group) or group < 16:
        raise ValueError(f"group={group}: must be a power of two >= 16")


def rms_norm_group_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int = 128,
                         residual: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """RMSNorm of x [M, H] (+ residual [M, H] first) quantized per token and K-group: (e4m3 [M, H],
    float32 scales [M, ceil(H / group)], the new residual x + residual or None without one). Bitwise
    `quantize_act(rms_norm(x, weight, eps[, residual]), group)`; rows wider than FUSED_NORM_MAX run exactly
    that composition. Inputs are not modified."""
    m, h = check_rms_norm_args(x, weight, eps, residual)
    _check_group(group)
    block = triton.next_power_of_2(max(h, 1))
    if block > FUSED_NORM_MAX:
        if residual is None:
            return (*quantize_act(rms_norm(x, weight, eps), group), None)
        out, res_out = rms_norm(x, weight, eps, residual=residual)
        return (*quantize_act(out, group), res_out)
    groups = triton.cdiv(h, group)
    q = torch.empty((m, h), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    res_out = torch.empty((m, h), dtype=x.dtype, device=x.device) if residual is not None else None
    if m > 0 and h > 0:
        _rms_norm_group_quant_kernel[(m,)](
            x, residual if residual is not None else x, weight, q, s, res_out if res_out is not None else x,
            h, float(eps),
            x.stride(0), residual.stride(0) if residual is not None else 0, q.stride(0), s.stride(0),
            res_out.stride(0) if res_out is not None else 0,
            # A group wider than the row is one group over the padded row (quantize_act's result too).
            HAS_RESIDUAL=residual is not None, BLOCK=block, GROUP=min(group, block), EPS=ACT_EPS,
            QMAX=FP8_MAX, HW=x.is_cuda,
            # rmsnorm.py's launch: its warps for this BLOCK (the same layout) and no FMA contraction.
            num_warps=max(1, min(16, block // 256)), enable_fp_fusion=False,
        )
    return q, s, res_out


@triton.jit(do_not_specialize=["M"])
def _silu_mul_group_quant_kernel(x_ptr, q_ptr, s_ptr, M, N_COLS, stride_x, stride_q, stride_s,
                                 ROWS: tl.constexpr, GROUP: tl.constexpr, EPS: tl.constexpr,
                                 QMAX: tl.constexpr, HW: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, GROUP)
    mask = (rows[:, None] < M) & (offs[None, :] < N_COLS)
    y = swiglu_values(x_ptr + rows[:, None] * stride_x, offs[None, :], mask, N_COLS)
    scale = row_scale(tl.max(tl.abs(y), axis=1), EPS, QMAX)
    q = e4m3_quotient(y, scale[:, None], QMAX, HW)
    tl.store(q_ptr + rows[:, None] * stride_q + offs[None, :],
             q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(s_ptr + rows * stride_s + g, scale, mask=rows < M)


def silu_and_mul_group_quant(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, 2I] = [gate | up] -> silu(gate) * up quantized per token and K-group: (e4m3 [M, I], float32
    scales [M, ceil(I / group)]); bitwise `quantize_act(silu_and_mul(x), group)` (kernels/activation.py,
    kernels/fp8_matmul.py)."""
    check_tensor("x", x, ndim=2)
    _check_group(group)
    m, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"x: last dimension {two_i} must be even (gate and up halves)")
    i = two_i // 2
    groups = triton.cdiv(i, group)
    q = torch.empty((m, i), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m and i:
        # Fewer rows per program for short batches (decode): the same per-element work, more programs.
        rows = min(_ACT_ROWS, triton.next_power_of_2(m))
        _silu_mul_group_quant_kernel[(triton.cdiv(m, rows), groups)](
            x, q, s, m, i, x.stride(0), q.stride(0), s.stride(0), ROWS=rows, GROUP=group, EPS=ACT_EPS,
            QMAX=FP8_MAX, HW=x.is_cuda, num_warps=4)
    return q, s
