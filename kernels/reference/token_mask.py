"""Packed token bitmasks: layout, argument checks and the plain-torch masking (the kernels' reference).

Bitmask layout (the one xgrammar and llguidance fill): int32 [S, ceil(V / 32)], row-aligned with the logits;
token v of row s is allowed iff bit (v % 32) of word bitmask[s, v // 32] is set. Bits past V are ignored.
`row_indices` restricts the update to those rows (constrained requests); other rows are left untouched.
`bitmask_rows` (same length as the rows updated) lets logits row row_indices[i] read bitmask row
bitmask_rows[i] instead of its own index, so a bitmask kept per request (a slot per request, filled before
the step's batch order is known) is applied without first gathering it into batch order. Each row is
masked from one bitmask row only, so the result is batch-invariant."""

from __future__ import annotations

import torch
from deepinfer.kernels._checks import check_tensor

_INDEX_DTYPES = (torch.int64, torch.int32)


def _check_index(name: str, t: torch.Tensor, device: torch.device, bound: int) -> None:
    check_tensor(name, t, ndim=1, dtypes=_INDEX_DTYPES, device=device)
    if t.numel() and device.type == "cpu":
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= bound:
            raise ValueError(f"{name}: values must be in [0, {bound}), got range [{lo}, {hi}]")


def check_bitmask_args(logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor | None,
                       bitmask_rows: torch.Tensor | None = None) -> None:
    check_tensor("logits", logits, ndim=2)
    check_tensor("bitmask", bitmask, ndim=2, dtypes=(torch.int32,), device=logits.device)
    s, v = logits.shape
    words = (v + 31) // 32
    if bitmask_rows is None and bitmask.shape != (s, words):
        raise ValueError(
            f"bitmask: shape {tuple(bitmask.shape)}, expected ({s}, {words}) = (logits rows, ceil(V / 32)) "
            f"for logits {tuple(logits.shape)}"
        )
    if bitmask_rows is not None and bitmask.shape[1] != words:
        raise ValueError(f"bitmask: {bitmask.shape[1]} words per row, expected ceil(V / 32) = {words} "
                         f"for logits {tuple(logits.shape)}")
    if row_indices is not None:
        _check_index("row_indices", row_indices, logits.device, s)
    if bitmask_rows is not None:
        _check_index("bitmask_rows", bitmask_rows, logits.device, bitmask.shape[0])
        n = s if row_indices is None else row_indices.numel()
        if bitmask_rows.numel() != n:
            raise ValueError(f"bitmask_rows: {bitmask_rows.numel()} entries, expected one per updated "
                             f"logits row ({n})")


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [R, vocab_size]: True where the token is allowed (bit set)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_torch_(logits: torch.Tensor, bitmask: torch.Tensor,
                               row_indices: torch.Tensor | None = None,
                               bitmask_rows: torch.Tensor | None = None) -> None:
    """Plain-torch version (the kernels' reference)."""
    check_bitmask_args(logits, bitmask, row_indices, bitmask_rows)
    v = logits.shape[1]
    if bitmask_rows is not None:
        bitmask = bitmask[bitmask_rows.long()]
        if row_indices is None:
            logits.masked_fill_(~unpack_bitmask(bitmask, v), float("-inf"))
            return
    elif row_indices is None:
        logits.masked_fill_(~unpack_bitmask(bitmask, v), float("-inf"))
        return
    else:
        bitmask = bitmask[row_indices.long()]
    if row_indices.numel() == 0:
        return
    rows = row_indices.long()
    logits[rows] = logits[rows].masked_fill(~unpack_bitmask(bitmask, v), float("-inf"))
