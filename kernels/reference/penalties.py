"""Plain-torch reference of the penalty kernel (kernels/penalties.py), and its argument checks.

Penalties change a sparse set of logits: for each entry (j, v, c) of `entries` (int32 [3, E]), the logit
x = logits[rows[j], v] of a token the row has seen (in its prompt or outputs; c = its output count) becomes

  x = x / r if x > 0 else x * r          repetition penalty r = params[0, j] (1: unchanged)
  x = x - (f * c + p * (c > 0))          frequency f = params[2, j], presence p = params[1, j]

in float32, each operation rounded on its own (IEEE division; no fused multiply-add), so the result is the
same bits as the dense form over a [rows, V] table (where the tokens a row has not seen are unchanged).
Entries of one row name distinct tokens, so every logit is written at most once and their order is free.
"""

from __future__ import annotations

import torch


def check_penalty_args(logits: torch.Tensor, rows: torch.Tensor, params: torch.Tensor,
                       entries: torch.Tensor) -> None:
    """ValueError naming the argument unless logits are float32 [S, V] with unit stride along V, rows int64
    [P], params float32 [3, P], entries int32 [3, E], the last three contiguous, all on the logits' device."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or (logits.numel() and logits.stride(1) != 1):
        raise ValueError(f"logits: expected float32 [S, V] with unit stride along V, got {logits.dtype} "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    if rows.dim() != 1 or rows.dtype != torch.int64:
        raise ValueError(f"rows: expected int64 [P], got {rows.dtype} {tuple(rows.shape)}")
    p = rows.shape[0]
    if params.dtype != torch.float32 or tuple(params.shape) != (3, p):
        raise ValueError(f"params: expected float32 [3, {p}], got {params.dtype} {tuple(params.shape)}")
    if entries.dtype != torch.int32 or entries.dim() != 2 or entries.shape[0] != 3:
        raise ValueError(f"entries: expected int32 [3, E], got {entries.dtype} {tuple(entries.shape)}")
    for name, t in (("rows", rows), ("params", params), ("entries", entries)):
        if t.device != logits.device:
            raise ValueError(f"{name}: on {t.device}, logits on {logits.device}")
        if not t.is_contiguous():   # the kernel indexes them as flat arrays
            raise ValueError(f"{name}: must be contiguous, got strides {t.stride()}")


def apply_penalties_ref(logits: torch.Tensor, rows: torch.Tensor, params: torch.Tensor,
                        entries: torch.Tensor) -> None:
    """In place on float32 logits [S, V]: the penalties of the module docstring."""
    check_penalty_args(logits, rows, params, entries)
    j = entries[0].long()
    at = (rows.index_select(0, j), entries[1].long())
    x = logits[at]
    r, p, f = (params[i].index_select(0, j) for i in range(3))
    x = torch.where(x > 0, x / r, x * r)
    count = entries[2].to(torch.float32)
    x = x - (f * count + p * (count > 0).to(torch.float32))
    logits.index_put_(at, x)
