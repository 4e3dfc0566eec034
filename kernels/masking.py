"""Token-bitmask application for the engine: the Triton kernel on CUDA, a numpy-unpacked version on CPU.

Triton is imported only when a CUDA tensor is masked, so CPU engines never need it. On CPU the bits are
unpacked with numpy's `unpackbits` (one byte-level pass; the shift-and-mask reference materialises an int32
per token and is ~3x slower at a 128k vocabulary) and selected with one `torch.where`; the result is the
reference's exactly (a select, no arithmetic), which tests/kernels/test_structured_token_mask.py checks.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from deepinfer.kernels.reference.token_mask import apply_token_bitmask_torch_, check_bitmask_args


def _apply_cpu_(logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor | None,
                bitmask_rows: torch.Tensor | None) -> None:
    check_bitmask_args(logits, bitmask, row_indices, bitmask_rows)
    v = logits.shape[1]
    if bitmask_rows is not None:
        src = bitmask[bitmask_rows.long()]
    elif row_indices is not None:
        src = bitmask[row_indices.long()]
    else:
        src = bitmask
    if src.shape[0] == 0 or v == 0:
        return
    # Little-endian int32 words as bytes: byte k of row r holds tokens 8k..8k+7, lowest bit first.
    packed = src.contiguous().numpy().view(np.uint8)
    allowed = torch.from_numpy(np.unpackbits(packed, axis=1, count=v, bitorder="little").view(np.bool_))
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype)
    if row_indices is None:
        if logits.is_contiguous():
            torch.where(allowed, logits, neg_inf, out=logits)
        else:
            logits.masked_fill_(~allowed, float("-inf"))
        return
    rows = row_indices.long()
    logits[rows] = torch.where(allowed, logits[rows], neg_inf)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor,
                         row_indices: torch.Tensor | None = None,
                         bitmask_rows: torch.Tensor | None = None) -> None:
    """Set logits[r, v] = -inf wherever bit v of the row's bitmask row is clear, for r in row_indices (or all
    rows); the i-th updated row reads bitmask row bitmask_rows[i] when given, else its own index.

    logits: float [S, V] (fp32/bf16/fp16), modified in place. bitmask: int32 [S or any, ceil(V/32)] on the
    same device. row_indices, bitmask_rows: int64/int32 [R] on the same device, or None.
    """
    if logits.is_cuda:
        from deepinfer.kernels.token_mask import apply_token_bitmask_triton_

        apply_token_bitmask_triton_(logits, bitmask, row_indices, bitmask_rows)
    elif logits.device.type == "cpu" and sys.byteorder == "little":
        _apply_cpu_(logits, bitmask, row_indices, bitmask_rows)
    else:
        apply_token_bitmask_torch_(logits, bitmask, row_indices, bitmask_rows)
