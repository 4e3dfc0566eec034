"""Plain-torch reference of DeepSeek-V4's Lightning Indexer scores (kernels/v4_indexer.py is the kernel).

Per query token t and compressed entry c (rows of a cache gathered by slot):
    total[t, c] = sum_h weights[t, h] * relu(q[t, h, :] . key[t, c, :]) * scale
heads summed in a fixed order, -inf where the entry is not valid for t (the top-k then skips it).
"""

from __future__ import annotations

import torch
from deepinfer.kernels._checks import check_tensor


def check_indexer_args(q: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                       valid: torch.Tensor) -> None:
    """ValueError naming the operand unless q [T, H, dim], weights [T, H] float32, rows [S, dim] in q's
    dtype with unit column stride, slots [T, C] int64 and valid [T, C] bool agree."""
    check_tensor("q", q, ndim=3)
    t, h, dim = q.shape
    check_tensor("weights", weights, ndim=2, dtypes=(torch.float32,), device=q.device,
                 last_dim_contiguous=False)
    if tuple(weights.shape) != (t, h):
        raise ValueError(f"weights: shape {tuple(weights.shape)}, expected ({t}, {h}): one per token, head")
    check_tensor("rows", rows, ndim=2, dtypes=(q.dtype,), device=q.device)
    if rows.shape[1] != dim:
        raise ValueError(f"rows: width {rows.shape[1]} differs from the indexer head dim {dim}; pass the "
                         "column view of the indexer key part")
    check_tensor("slots", slots, ndim=2, dtypes=(torch.int64,), device=q.device, last_dim_contiguous=False)
    check_tensor("valid", valid, ndim=2, dtypes=(torch.bool,), device=q.device, last_dim_contiguous=False)
    if slots.shape[0] != t or valid.shape != slots.shape:
        raise ValueError(f"slots {tuple(slots.shape)} / valid {tuple(valid.shape)} must both be [{t}, C]")


def head_weighted_scores(dots: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """dots [T, H, C] (q . key) -> total [T, C]: relu, scale, weight per head, summed head 0, 1, ... in
    turn (one fixed order), -inf where not valid."""
    scores = torch.relu(dots) * scale
    total = scores[:, 0] * weights[:, 0, None]
    for h in range(1, scores.shape[1]):
        total = total + scores[:, h] * weights[:, h, None]
    return total.masked_fill(~valid, float("-inf"))


def indexer_scores_ref(q: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                       valid: torch.Tensor, scale: float, invariant: bool = False) -> torch.Tensor:
    """Lightning Indexer scores [T, C] float32 of the entries rows[slots] (invalid ones read row 0, masked).
    `invariant`: one elementwise product and sum per (token, head, entry), whatever the batch."""
    check_indexer_args(q, weights, rows, slots, valid)
    keys = torch.where(valid[..., None], rows[torch.where(valid, slots, 0)], 0.0).float()
    qf = q.float()
    if invariant:
        dots = (qf.unsqueeze(2) * keys.unsqueeze(1)).sum(-1)
    else:
        dots = torch.einsum("thd,tcd->thc", qf, keys)
    return head_weighted_scores(dots, weights, valid, scale)
