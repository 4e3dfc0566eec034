"""Apply a packed token bitmask to logits in place: disallowed tokens get -inf.

Bitmask layout (the one xgrammar and llguidance fill): int32 [S, ceil(V / 32)], row-aligned with the logits;
token v of row s is allowed iff bit (v % 32) of word bitmask[s, v // 32] is set. Bits past V are ignored.
`row_indices` restricts the update to those rows (constrained requests); other rows are left untouched,
so unconstrained requests need no all-ones row. `bitmask_rows` makes the i-th updated row read bitmask row
bitmask_rows[i] (per-request mask slots, see engine/structured/manager.py). Each row is masked from one
bitmask row only, so the result is batch-invariant.

The layout, argument checks and the plain-torch version live in deepinfer.kernels.reference.token_mask;
deepinfer.kernels.masking dispatches between the two by device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels.reference.token_mask import check_bitmask_args

_BLOCK_V = 1024


@triton.jit
def _token_bitmask_kernel(
    logits_ptr, bitmask_ptr, rows_ptr, mask_rows_ptr,
    V, stride_logits, stride_bitmask,
    HAS_ROWS: tl.constexpr, HAS_MASK_ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_v = tl.program_id(1)
    if HAS_ROWS:
        row = tl.load(rows_ptr + pid_r).to(tl.int64)
    else:
        row = pid_r.to(tl.int64)
    if HAS_MASK_ROWS:
        mrow = tl.load(mask_rows_ptr + pid_r).to(tl.int64)
    else:
        mrow = row
    offs = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    in_range = offs < V
    # other=-1: out-of-range lanes read as "allowed" and are never stored anyway.
    words = tl.load(bitmask_ptr + mrow * stride_bitmask + offs // 32, mask=in_range, other=-1)
    allowed = (words >> (offs % 32)) & 1
    neg_inf = tl.full([BLOCK_V], float("-inf"), dtype=logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + offs, neg_inf, mask=in_range & (allowed == 0))


def apply_token_bitmask_triton_(logits: torch.Tensor, bitmask: torch.Tensor,
                                row_indices: torch.Tensor | None = None,
                                bitmask_rows: torch.Tensor | None = None) -> None:
    """Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1)."""
    check_bitmask_args(logits, bitmask, row_indices, bitmask_rows)
    s, v = logits.shape
    n_rows = s if row_indices is None else row_indices.numel()
    if n_rows == 0 or v == 0:
        return
    if logits.stride(0) < v and s > 1:
        raise ValueError(f"logits: rows overlap (stride {logits.stride(0)} < V={v})")
    if bitmask.shape[1] > 1 and bitmask.stride(1) != 1:
        raise ValueError("bitmask: last dimension must be contiguous")
    rows = row_indices if row_indices is not None else bitmask  # any pointer; unused without HAS_ROWS
    mask_rows = bitmask_rows if bitmask_rows is not None else bitmask
    grid = (n_rows, triton.cdiv(v, _BLOCK_V))
    _token_bitmask_kernel[grid](
        logits, bitmask, rows, mask_rows, v, logits.stride(0), bitmask.stride(0),
        HAS_ROWS=row_indices is not None, HAS_MASK_ROWS=bitmask_rows is not None, BLOCK_V=_BLOCK_V,
        num_warps=4,
    )
