"""DeepSeek-V4's Lightning Indexer scores as one Triton kernel, batch-invariant by construction.

    total[t, c] = sum_h weights[t, h] * relu(q[t, h, :] . key[t, c, :]) * scale,   -inf where not valid

with key[t, c] = rows[slots[t, c]] read straight from the compressed cache (no [T, C, dim] gather, no
[T, H, C, dim] products). Reference: kernels/reference/v4_indexer.py; the top-k stays torch.topk.

One program per (token, entry block): all the token's indexer heads (padded to a power of two >= 16) in
one tile against BLOCK_C entries, q . key on the tensor cores (bf16 operands are exact, fp32 accumulation;
float32 operands use IEEE fp32), then relu, scale and the head-weighted sum as one fixed reduction. An
entry's bits depend only on its own token's q, weights and key: never on the batch, T or C (entry blocks
are fixed by the entry index; invalid entries are masked at load and written as -inf).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels._checks import is_power_of_two
from deepinfer.kernels.reference.v4_indexer import check_indexer_args

__all__ = ["indexer_scores"]


def indexer_config(heads: int, dim: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile config: a function of the indexer shape only (never of the batch)."""
    block_h = max(16, triton.next_power_of_2(heads))
    block_c = 32 if dtype == torch.float32 or block_h * dim > 8192 else 64
    return {"BLOCK_H": block_h, "BLOCK_C": block_c, "num_warps": 4, "num_stages": 2}


# The entry count and the row / slot strides vary between calls: not specialised, so every step runs the
# same binary.
@triton.jit(do_not_specialize=["num_entries", "num_blocks", "stride_row", "stride_st", "stride_ot"])
def _indexer_scores_kernel(
    q_ptr, w_ptr, rows_ptr, slots_ptr, out_ptr, scale, num_entries, num_blocks,
    stride_qt, stride_qh, stride_wt, stride_wh, stride_row, stride_st, stride_ot,
    H: tl.constexpr, DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, IEEE: tl.constexpr,
):
    # One flat grid (no 65535 cap on T): a token's entry blocks are neighbours.
    pid = tl.program_id(0)
    t = (pid // num_blocks).to(tl.int64)
    idx = (pid % num_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    heads = tl.arange(0, BLOCK_H)
    h_ok = heads < H
    d = tl.arange(0, DIM)
    slot = tl.load(slots_ptr + t * stride_st + idx, mask=idx < num_entries, other=-1)
    ok = slot >= 0
    k = tl.load(rows_ptr + slot[:, None] * stride_row + d[None, :], mask=ok[:, None], other=0.0)
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=h_ok[:, None],
                other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_H, BLOCK_C]
    else:
        s = tl.dot(q, tl.trans(k))
    w = tl.load(w_ptr + t * stride_wt + heads * stride_wh, mask=h_ok, other=0.0)
    total = tl.sum(tl.maximum(s, 0.0) * scale * w[:, None], axis=0)
    total = tl.where(ok, total, float("-inf"))
    tl.store(out_ptr + t * stride_ot + idx, total, mask=idx < num_entries)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                   valid: torch.Tensor, scale: float) -> torch.Tensor:
    """Lightning Indexer scores [T, C] float32.

    q [T, H, dim] (bf16/fp16/fp32, the query after its rope), weights [T, H] float32 (per-head weights,
    already scaled), rows [S, dim] the indexer keys in q's dtype (may be a strided column view), slots
    [T, C] int64 and valid [T, C] bool: entry c of token t is rows[slots[t, c]] when valid[t, c].
    """
    check_indexer_args(q, weights, rows, slots, valid)
    t, h, dim = q.shape
    if not is_power_of_two(dim) or not 16 <= dim <= 512:
        raise ValueError(f"q: indexer head_dim {dim} unsupported (must be a power of two in [16, 512])")
    if h > 128:
        raise ValueError(f"q: {h} indexer heads, at most 128 supported (all heads share one tile)")
    c = slots.shape[1]
    out = torch.empty((t, c), dtype=torch.float32, device=q.device)
    if t == 0 or c == 0:
        return out
    q = q.contiguous() if q.stride(2) != 1 else q
    marked = torch.where(valid, slots, -1).contiguous()
    cfg = indexer_config(h, dim, q.dtype)
    num_blocks = triton.cdiv(c, cfg["BLOCK_C"])
    _indexer_scores_kernel[(num_blocks * t,)](
        q, weights, rows, marked, out, float(scale), c, num_blocks,
        q.stride(0), q.stride(1), weights.stride(0), weights.stride(1), rows.stride(0), marked.stride(0),
        out.stride(0),
        H=h, DIM=dim, BLOCK_H=cfg["BLOCK_H"], BLOCK_C=cfg["BLOCK_C"], IEEE=q.dtype == torch.float32,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
