"""Repetition / presence / frequency penalties on the sparse entries of a step, in one launch.

One program per block of entries (row, token, output count; kernels/reference/penalties.py states the
arithmetic): it reads each penalised logit, applies the row's penalties in float32 and writes it back, so a
step touches only the logits its rows have seen instead of building [rows, vocab] tables. Division is
IEEE (`div_rn`, as torch's) and the launch turns off fused multiply-add, so `f * c + p * present` rounds
each product as torch's separate kernels do: the bits are the reference's.

Imported only from the CUDA path (or under TRITON_INTERPRET=1): it imports Triton at module level.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels.pdl import pdl_options, wait_for_producers
from deepinfer.kernels.reference.penalties import check_penalty_args

BLOCK = 1024


@triton.jit
def _penalty_kernel(logits_ptr, stride_row, rows_ptr, params_ptr, entries_ptr, num_rows, num_entries,
                    BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_producers(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_entries
    j = tl.load(entries_ptr + offs, mask=ok, other=0)
    token = tl.load(entries_ptr + num_entries + offs, mask=ok, other=0)
    count = tl.load(entries_ptr + 2 * num_entries + offs, mask=ok, other=0).to(tl.float32)
    row = tl.load(rows_ptr + j, mask=ok, other=0)
    rep = tl.load(params_ptr + j, mask=ok, other=1.0)
    presence = tl.load(params_ptr + num_rows + j, mask=ok, other=0.0)
    frequency = tl.load(params_ptr + 2 * num_rows + j, mask=ok, other=0.0)
    ptr = logits_ptr + row * stride_row + token
    x = tl.load(ptr, mask=ok, other=0.0)
    x = tl.where(x > 0, tl.math.div_rn(x, rep), x * rep)
    present = tl.where(count > 0, 1.0, 0.0)
    x = x - (frequency * count + presence * present)
    tl.store(ptr, x, mask=ok)


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, params: torch.Tensor,
                    entries: torch.Tensor) -> None:
    """In place on float32 logits [S, V]; the arguments as `apply_penalties_ref`'s."""
    check_penalty_args(logits, rows, params, entries)
    num_entries = entries.shape[1]
    if num_entries == 0:
        return
    grid = (triton.cdiv(num_entries, BLOCK),)
    _penalty_kernel[grid](logits, logits.stride(0), rows, params, entries, rows.shape[0], num_entries,
                          BLOCK=BLOCK, enable_fp_fusion=False, **pdl_options(logits.device))
