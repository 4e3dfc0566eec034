"""Packed token bitmasks: layout, argument checks and the plain-torch masking (CPU path and reference).

Bitmask layout (the one xgrammar and llguidance fill): int32 [S, ceil(V / 32)], row-aligned with the logits;
token v of row s is allowed iff bit (v % 32) of word bitmask[s, v // 32] is set. Bits past V are ignored.
`row_indices` restricts the update to those rows (constrained requests); other rows are left untouched.
Each row is masked from its own bitmask row only, so the result is batch-invariant."""

from __future__ import annotations

import torch
from deepinfer.kernels._checks import check_tensor


def check_bitmask_args(logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor | None) -> None:
    check_tensor("logits", logits, ndim=2)
    check_tensor("bitmask", bitmask, ndim=2, dtypes=(torch.int32,), device=logits.device)
    s, v = logits.shape
    words = (v + 31) // 32
    if bitmask.shape != (s, words):
        raise ValueError(
            f"bitmask: shape {tuple(bitmask.shape)}, expected ({s}, {words}) = (logits rows, ceil(V / 32)) "
            f"for logits {tuple(logits.shape)}"
        )
    if row_indices is not None:
        check_tensor("row_indices", row_indices, ndim=1, dtypes=(torch.int64, torch.int32),
                     device=logits.device)
        if row_indices.numel() and logits.device.type == "cpu":
            lo, hi = int(row_indices.min()), int(row_indices.max())
            if lo < 0 or hi >= s:
                raise ValueError(f"row_indices: values must be in [0, {s}), got range [{lo}, {hi}]")


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [R, vocab_size]: True where the token is allowed (bit set)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_torch_(logits: torch.Tensor, bitmask: torch.Tensor,
                               row_indices: torch.Tensor | None = None) -> None:
    """Plain-torch version (CPU path and the kernel's reference)."""
    check_bitmask_args(logits, bitmask, row_indices)
    v = logits.shape[1]
    if row_indices is None:
        logits.masked_fill_(~unpack_bitmask(bitmask, v), float("-inf"))
        return
    if row_indices.numel() == 0:
        return
    rows = row_indices.long()
    logits[rows] = logits[rows].masked_fill(~unpack_bitmask(bitmask[rows], v), float("-inf"))
