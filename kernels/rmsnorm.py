"""RMSNorm (optionally fused with the residual add), matching Hugging Face Llama/Qwen2 rounding.

HF computes, in the input dtype `dt`: h = residual + x (rounded to dt), then
out = weight * (h.float() * rsqrt(mean(h.float()^2) + eps)).to(dt). This kernel does the same steps with
the same roundings. One program per row; the sum of squares is reduced in a fixed order that depends
only on H (chunk width and tree shape are functions of H), so a row's bits never depend on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels._checks import check_same_dtype, check_tensor
from deepinfer.kernels.gemm_parts import sum_partials
from deepinfer.kernels.matmul_split import SplitSum
from deepinfer.kernels.pdl import pdl_options, wait_for_producers

# Widest chunk one program holds in registers; rows longer than this are reduced chunk by chunk.
_MAX_BLOCK = 8192


@triton.jit
def load_x(x_row, offs, mask, split_stride, xb_ptr, res_row, SPLITS: tl.constexpr, HAS_XBIAS: tl.constexpr):
    """x at columns `offs` of a row: loaded (SPLITS == 0), or a parallel split-K's result summed from its
    fp32 partials (x_row in part[0]; part[s] `split_stride` further; + the GEMM's bias at xb_ptr) and rounded
    to the dtype of res_row, exactly as kernels/matmul_split.py's reduce stores it."""
    if SPLITS == 0:
        x = tl.load(x_row + offs, mask=mask, other=0.0)
    else:
        acc = sum_partials(x_row, offs, mask, split_stride, xb_ptr, offs, SPLITS, HAS_XBIAS)
        x = acc.to(res_row.dtype.element_ty)
    return x


@triton.jit
def rms_norm_row(x_row, r_row, w_ptr, res_row, offs, H, eps, HAS_RESIDUAL: tl.constexpr, split_stride, xb_ptr,
                 SPLITS: tl.constexpr, HAS_XBIAS: tl.constexpr):
    """One row held whole (offs covers H): h = x (+ r, rounded to x's dtype, stored to res_row), then
    weight * (h * rstd rounded to x's dtype), as fp32, and the column mask; x as `load_x` gives it. The
    single-chunk body of _rms_norm_kernel and of kernels/fp8_fused_quant.py's fused norm, one copy so that
    both compute the same operations (Triton inlines it; the sum's bits also need the same layout, see that
    module)."""
    mask = offs < H
    h = load_x(x_row, offs, mask, split_stride, xb_ptr, res_row, SPLITS, HAS_XBIAS)
    if HAS_RESIDUAL:
        h = (h.to(tl.float32) + tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)).to(h.dtype)
        tl.store(res_row + offs, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / H + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (hf * rstd).to(h.dtype).to(tl.float32) * w
    return y, mask


@triton.jit
def _chunk_h(x_row, r_row, start, offs, H, HAS_RESIDUAL: tl.constexpr, split_stride, xb_ptr, res_row,
             SPLITS: tl.constexpr, HAS_XBIAS: tl.constexpr):
    """The chunk of h = x (+ r, rounded to x's dtype) at columns start + offs, and its column mask: both
    passes of the multi-chunk path compute it the same way."""
    mask = start + offs < H
    h = load_x(x_row, start + offs, mask, split_stride, xb_ptr, res_row, SPLITS, HAS_XBIAS)
    if HAS_RESIDUAL:
        r = tl.load(r_row + start + offs, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
    return h, mask


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, xb_ptr,
    H, eps, split_stride,
    stride_x, stride_r, stride_out, stride_res_out,
    HAS_RESIDUAL: tl.constexpr, SINGLE_CHUNK: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr,
    HAS_XBIAS: tl.constexpr, PDL: tl.constexpr = 0,
):
    wait_for_producers(PDL)   # kernels/pdl.py: before any load
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    out_row = out_ptr + row * stride_out
    res_row = res_out_ptr + row * stride_res_out
    if SINGLE_CHUNK:
        y, mask = rms_norm_row(x_row, r_row, w_ptr, res_row, offs, H, eps, HAS_RESIDUAL, split_stride, xb_ptr,
                               SPLITS, HAS_XBIAS)
        tl.store(out_row + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        sq = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, H, BLOCK):
            h, mask = _chunk_h(x_row, r_row, start, offs, H, HAS_RESIDUAL, split_stride, xb_ptr, res_row,
                              SPLITS, HAS_XBIAS)
            if HAS_RESIDUAL:
                tl.store(res_row + start + offs, h, mask=mask)
            hf = h.to(tl.float32)
            sq += hf * hf
        rstd = tl.rsqrt(tl.sum(sq, axis=0) / H + eps)
        for start in range(0, H, BLOCK):
            # Recompute the sum rather than re-read res_out: no cross-thread visibility question arises.
            h, mask = _chunk_h(x_row, r_row, start, offs, H, HAS_RESIDUAL, split_stride, xb_ptr, res_row,
                              SPLITS, HAS_XBIAS)
            w = tl.load(w_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
            y = (h.to(tl.float32) * rstd).to(h.dtype).to(tl.float32) * w
            tl.store(out_row + start + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def check_rms_norm_args(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
                        ) -> tuple[int, int]:
    """ValueError naming the argument unless x [M, H], weight [H], eps >= 0 and residual (None or x's
    shape and dtype) fit `rms_norm` (and kernels/fp8_fused_quant.py's `rms_norm_quant`); returns (M, H)."""
    check_tensor("x", x, ndim=2)
    m, h = x.shape
    _check_norm_operands(weight, eps, residual, m, h, x.dtype, x.device)
    return m, h


def _check_split_sum(x: SplitSum, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
                     ) -> tuple[int, int]:
    """`check_rms_norm_args` for x given as a split-K's partials; returns (M, H)."""
    check_tensor("x.part", x.part, ndim=3, dtypes=(torch.float32,))
    if not x.part.is_contiguous():
        raise ValueError("x.part: the split-K partials must be contiguous")
    _, m, h = x.part.shape
    if x.bias is not None:
        check_tensor("x.bias", x.bias, ndim=1, device=x.device)
        check_same_dtype("x.bias", x.bias, x.dtype)
        if x.bias.shape[0] != h:
            raise ValueError(f"x.bias: shape {tuple(x.bias.shape)}, expected ({h},)")
    _check_norm_operands(weight, eps, residual, m, h, x.dtype, x.device)
    return m, h


def _check_norm_operands(weight: torch.Tensor, eps: float, residual: torch.Tensor | None, m: int, h: int,
                         dtype: torch.dtype, device: torch.device) -> None:
    """The checks of weight, eps and residual against an x of shape (m, h), `dtype`, on `device`."""
    check_tensor("weight", weight, ndim=1, device=device)
    if weight.shape[0] != h:
        raise ValueError(f"weight: shape {tuple(weight.shape)}, expected ({h},) to match x {(m, h)}")
    if not eps >= 0:
        raise ValueError(f"eps={eps}: must be >= 0")
    if residual is not None:
        check_tensor("residual", residual, ndim=2, device=device)
        check_same_dtype("residual", residual, dtype)
        if residual.shape != (m, h):
            raise ValueError(f"residual: shape {tuple(residual.shape)} differs from x {(m, h)}")


def rms_norm(
    x: torch.Tensor | SplitSum,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [M, H] with weight [H]; returns out [M, H] in x's dtype.

    With `residual` [M, H]: h = x + residual (rounded to x's dtype) is normalised and the function returns
    (out, h), h being the new residual stream. Inputs are not modified. x may be a parallel split-K's
    partials (`SplitSum`, from `bi_linear(..., defer_sum=True)`): the kernel sums them in the reduce's
    order and rounding, so the result has the bits of `rms_norm(x.materialize(), ...)` without the reduce.
    """
    if isinstance(x, SplitSum):
        m, h = _check_split_sum(x, weight, eps, residual)
        x_arg, splits, split_stride, stride_x, xb = x.part, x.part.shape[0], m * h, h, x.bias
    else:
        m, h = check_rms_norm_args(x, weight, eps, residual)
        x_arg, splits, split_stride, stride_x, xb = x, 0, 0, x.stride(0), None
    out = torch.empty((m, h), dtype=x.dtype, device=x.device)
    res_out = torch.empty((m, h), dtype=x.dtype, device=x.device) if residual is not None else out
    if m > 0 and h > 0:
        block = min(triton.next_power_of_2(h), _MAX_BLOCK)
        num_warps = max(1, min(16, block // 256))
        _rms_norm_kernel[(m,)](
            x_arg, residual if residual is not None else x_arg, weight, out, res_out,
            xb if xb is not None else weight,
            h, float(eps), split_stride,
            stride_x, residual.stride(0) if residual is not None else 0, out.stride(0), res_out.stride(0),
            HAS_RESIDUAL=residual is not None, SINGLE_CHUNK=block >= h, BLOCK=block, SPLITS=splits,
            HAS_XBIAS=xb is not None,
            # No FMA contraction: with it the compiler fuses some squares of the sum into its adds and not
            # others, differently in any kernel around the same lines (kernels/fp8_fused_quant.py's norm
            # must give these bits); without it the sum is the source's products and adds in the layout's
            # order. Nothing else here has a multiply feeding an add.
            num_warps=num_warps, enable_fp_fusion=False, **pdl_options(x.device),
        )
    return (out, res_out) if residual is not None else out
