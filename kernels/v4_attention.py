"""DeepSeek-V4's gathered sink attention as one Triton kernel, batch-invariant by construction.

Each query token attends to its own list of keys (K = V, one shared head for all query heads): the rows of
its sliding window, then its chosen compressed entries, read straight from the caches by slot (nothing is
gathered into a [T, L, D] tensor first). The softmax denominator also holds a per-head sink exp(sink_h).
Reference: kernels/reference/v4_attention.py.

One program per (token, head block): BLOCK_H query heads of one token share every key tile, which is loaded
once and used for both products (q k^T, then p v with v = k). The key list is walked in tiles of BLOCK_N,
source by source, with an fp32 online softmax that starts from the sink (running max = sink, sum = 1), so
the max is always finite. Why a token's bits never depend on the batch, T, or the padding of its lists:
- the tile config depends only on (heads, head_dim, dtype), and a program's arithmetic only on its token;
- a source's tiles start at its index 0, so a key's tile and lane are fixed by the token's own lists;
- the loop stops after the token's last valid key; an invalid key inside a tile is masked at load (no bits
  of an unwritten row enter) and scores -inf, p = 0: it adds exact zeros, and a tile that leaves the max
  unchanged rescales by exactly 1 (not by a hardware exp2 of 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from deepinfer.kernels._checks import is_power_of_two
from deepinfer.kernels.reference.v4_attention import KeySource, check_v4_attention_args

__all__ = ["v4_sink_attention", "sink_attention_config"]

_LOG2E = 1.4426950408889634


def sink_attention_config(heads: int, head_dim: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile config: a function of the model shape only (never of the batch). BLOCK_H >= 16 for tl.dot."""
    wide = head_dim >= 256
    if dtype == torch.float32:
        block_n, stages = (16, 1) if wide else (32, 2)
    else:
        block_n, stages = (32, 2) if wide else (64, 2)
    return {"BLOCK_H": 16, "BLOCK_N": block_n, "num_warps": 8 if wide else 4, "num_stages": stages}


@triton.jit
def _source(q, m_i, l_i, acc, rows_ptr, stride_row, slots_row, n, d, qk_scale,
            BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    # One source's keys, tiles [0, BLOCK_N), [BLOCK_N, 2 * BLOCK_N), ... up to its last valid key n - 1.
    for j in range(0, n, BLOCK_N):
        idx = j + tl.arange(0, BLOCK_N)
        slot = tl.load(slots_row + idx, mask=idx < n, other=-1)
        ok = slot >= 0
        k = tl.load(rows_ptr + slot[:, None] * stride_row + d[None, :], mask=ok[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_new))
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if IEEE:
            acc = tl.dot(p.to(k.dtype), k, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(k.dtype), k, acc)
        m_i = m_new
    return m_i, l_i, acc


# Row strides and lengths vary between calls: not specialised, so every step runs the same binary.
@triton.jit(do_not_specialize=["stride_a", "stride_as", "stride_b", "stride_bs"])
def _sink_attention_kernel(
    q_ptr, out_ptr, sinks_ptr, a_ptr, a_slots, a_len, b_ptr, b_slots, b_len, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_a, stride_as, stride_b, stride_bs,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_HB: tl.constexpr,
    HAS_B: tl.constexpr, IEEE: tl.constexpr, LOG2E: tl.constexpr,
):
    # One flat grid (no 65535 cap on T); a token's head blocks are neighbours and share its keys in L2.
    pid = tl.program_id(0)
    heads = (pid % NUM_HB) * BLOCK_H + tl.arange(0, BLOCK_H)
    t = (pid // NUM_HB).to(tl.int64)
    h_ok = heads < H
    d = tl.arange(0, D)
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=h_ok[:, None],
                other=0.0)
    # Start from the sink: max = sink (log2 units), sum = exp2(0) = 1, nothing accumulated.
    m_i = tl.load(sinks_ptr + heads, mask=h_ok, other=0.0) * LOG2E
    l_i = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    m_i, l_i, acc = _source(q, m_i, l_i, acc, a_ptr, stride_a, a_slots + t * stride_as,
                            tl.load(a_len + t), d, qk_scale, BLOCK_N, IEEE)
    if HAS_B:
        m_i, l_i, acc = _source(q, m_i, l_i, acc, b_ptr, stride_b, b_slots + t * stride_bs,
                                tl.load(b_len + t), d, qk_scale, BLOCK_N, IEEE)
    out = acc / l_i[:, None]
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


def _masked_slots(slots: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots with -1 where invalid, contiguous; per token the index after its last valid key, int32)."""
    n = slots.shape[1]
    marked = torch.where(valid, slots, -1).contiguous()
    if n == 0:
        return marked, torch.zeros(slots.shape[0], dtype=torch.int32, device=slots.device)
    pos = torch.arange(1, n + 1, dtype=torch.int32, device=slots.device)
    lengths = torch.where(valid, pos[None, :], 0).amax(dim=1).to(torch.int32)
    return marked, lengths


def v4_sink_attention(
    q: torch.Tensor,
    sources: Sequence[KeySource],
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Gathered sink attention: q [T, H, D] -> [T, H, D] in q's dtype.

    `sources`: one or two (rows [S, D], slots [T, L] int64, valid [T, L] bool); token t attends to
    rows[slots[t, j]] of every source where valid[t, j], sources in order. `rows` may be a strided column
    view of a wider cache row (unit column stride). sinks [H] float32; scores are q . k * scale.
    """
    check_v4_attention_args(q, sources, sinks)
    t, h, d = q.shape
    if not is_power_of_two(d) or not 16 <= d <= 1024:
        raise ValueError(f"q: head_dim {d} unsupported (must be a power of two in [16, 1024])")
    if q.stride(2) != 1:
        raise ValueError(f"q: last dimension must be contiguous, got strides {tuple(q.stride())}")
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    prepared = [(rows, *_masked_slots(slots, valid)) for rows, slots, valid in sources]
    a_rows, a_slots, a_len = prepared[0]
    b_rows, b_slots, b_len = prepared[1] if len(prepared) > 1 else prepared[0]
    cfg = sink_attention_config(h, d, q.dtype)
    num_hb = -(-h // cfg["BLOCK_H"])
    _sink_attention_kernel[(num_hb * t,)](
        q, out, sinks, a_rows, a_slots, a_len, b_rows, b_slots, b_len, float(scale) * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        a_rows.stride(0), a_slots.stride(0), b_rows.stride(0), b_slots.stride(0),
        H=h, D=d, BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], NUM_HB=num_hb, HAS_B=len(prepared) > 1,
        IEEE=q.dtype == torch.float32, LOG2E=_LOG2E,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
