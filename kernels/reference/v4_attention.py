"""Plain-torch reference of DeepSeek-V4's gathered sink attention (kernels/v4_attention.py is the kernel).

Every query token t attends to its own list of keys (K = V, one shared head): rows of a cache gathered by
slot, from one or two sources (the sliding window's rows, then the chosen compressed entries), each with a
validity mask. The softmax denominator also holds a learned per-head sink, exp(sink_h), that weights no
value. Invalid keys contribute exact zeros, so a token's result never depends on how far its lists were
padded to the batch's longest.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from deepinfer.kernels._checks import check_tensor
from deepinfer.kernels.reference.pointwise import fixed_path

# (rows [S, D], slots [T, L] int64, valid [T, L] bool): one source of a token's keys.
KeySource = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _pow2_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` zero-padded to a power of two, by halving: the order depends on the length alone and
    trailing zeros never change a bit, so a token's sum is the same whatever padding the batch needed."""
    n = x.shape[dim]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        pad = list(x.shape)
        pad[dim] = width - n
        x = torch.cat([x, x.new_zeros(pad)], dim=dim)
    while width > 1:
        width //= 2
        x = x.narrow(dim, 0, width) + x.narrow(dim, width, width)
    return x.squeeze(dim)


def sink_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    invariant: bool,
) -> torch.Tensor:
    """q [T, H, D], keys = values [T, L, D], valid [T, L] -> [T, H, D] float32; the sink adds exp(sink) to
    the softmax denominator only. Keys are ordered per token (window, then chosen compressed entries) with
    the invalid ones zeroed, so padding contributes exact zeros. `invariant`: elementwise products and
    power-of-two halving sums, so a token's bits are the same whatever else shares the call."""
    qf = q.to(torch.float32)
    kf = torch.where(valid[..., None], keys.to(torch.float32), 0.0)
    if invariant:
        scores = (qf.unsqueeze(2) * kf.unsqueeze(1)).sum(-1) * scale  # [T, H, L]
    else:
        scores = torch.einsum("thd,tld->thl", qf, kf) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.to(torch.float32)[None, :].expand(scores.shape[0], -1)
    m = torch.maximum(scores.amax(dim=-1), sink)  # [T, H]: exact, and finite thanks to the sink
    exp = (lambda t: fixed_path(torch.exp, t)) if invariant else torch.exp
    p = exp(scores - m[..., None])
    if invariant:
        denom = _pow2_sum(p, 2) + exp(sink - m)
        acc = _pow2_sum(p.unsqueeze(-1) * kf.unsqueeze(1), 2) + 0.0
    else:
        denom = p.sum(-1) + exp(sink - m)
        acc = torch.einsum("thl,tld->thd", p, kf)
    return acc / denom[..., None]


def check_v4_attention_args(
    q: torch.Tensor, sources: Sequence[KeySource], sinks: torch.Tensor
) -> None:
    """ValueError naming the operand unless q [T, H, D], sinks [H] float32 and every (rows [S, D] with
    q's dtype and unit column stride, slots [T, L] int64, valid [T, L] bool) agree."""
    check_tensor("q", q, ndim=3)
    t, h, d = q.shape
    check_tensor("sinks", sinks, ndim=1, dtypes=(torch.float32,), device=q.device)
    if sinks.shape[0] != h:
        raise ValueError(f"sinks: shape {tuple(sinks.shape)}, expected ({h},): one sink per query head")
    if not 1 <= len(sources) <= 2:
        raise ValueError(f"sources: {len(sources)} key sources given, expected 1 or 2 (window, compressed)")
    for i, (rows, slots, valid) in enumerate(sources):
        check_tensor(f"sources[{i}].rows", rows, ndim=2, dtypes=(q.dtype,), device=q.device)
        if rows.shape[1] != d:
            raise ValueError(f"sources[{i}].rows: width {rows.shape[1]} differs from the head dim {d}; "
                             "pass the column view of the key part (rows[:, a:a + head_dim])")
        check_tensor(f"sources[{i}].slots", slots, ndim=2, dtypes=(torch.int64,), device=q.device,
                     last_dim_contiguous=False)
        check_tensor(f"sources[{i}].valid", valid, ndim=2, dtypes=(torch.bool,), device=q.device,
                     last_dim_contiguous=False)
        if slots.shape[0] != t or valid.shape != slots.shape:
            raise ValueError(f"sources[{i}]: slots {tuple(slots.shape)} / valid {tuple(valid.shape)} must "
                             f"both be [{t}, L] (one row per query token)")


def gather_keys(sources: Sequence[KeySource]) -> tuple[torch.Tensor, torch.Tensor]:
    """The sources' rows gathered per token and concatenated in order: keys [T, L, D], valid [T, L].
    Invalid slots may hold anything (even -1): they read row 0 and are masked."""
    keys = [rows[torch.where(valid, slots, 0)] for rows, slots, valid in sources]
    valid = [v for _, _, v in sources]
    if len(keys) == 1:
        return keys[0], valid[0]
    return torch.cat(keys, dim=1), torch.cat(valid, dim=1)


def v4_sink_attention_ref(
    q: torch.Tensor,
    sources: Sequence[KeySource],
    sinks: torch.Tensor,
    scale: float,
    invariant: bool = False,
) -> torch.Tensor:
    """Gathered sink attention, [T, H, D] float32: token t attends to the valid rows of every source."""
    check_v4_attention_args(q, sources, sinks)
    keys, valid = gather_keys(sources)
    return sink_attention(q, keys, valid, sinks, scale, invariant)
