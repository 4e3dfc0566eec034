"""Plain-torch references of kernels/mla_decode.py (absorbed MLA attention) and kernels/mla_proj.py.

`mla_decode_ref` computes, per new token and head, softmax(scale * q_abs . entry) over the token's causal
context read through the block table, times the context's latents — float32, one plain softmax, no
chunking or splitting, so it is independent of the kernel's tiling. `head_proj_ref` is the per-head
projection out[t, h] = W[h] @ x[t, h]. The kernel's split-KV layout is kernels/split_plan.py's
`split_counts`.
"""

from __future__ import annotations

import torch
from deepinfer.kernels._checks import check_same_dtype, check_tensor
from deepinfer.kernels.metadata import AttentionMetadata


def check_mla_decode_args(q_abs: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                          rank: int) -> None:
    """ValueError naming the argument unless q_abs [T, H, R+P], cache [blocks, block_size, R+P] and meta
    agree."""
    check_tensor("q_abs", q_abs, ndim=3)
    check_tensor("cache", cache, ndim=3, device=q_abs.device)
    check_same_dtype("cache", cache, q_abs.dtype)
    width = q_abs.shape[2]
    if cache.shape[2] != width:
        raise ValueError(f"q_abs width {width} differs from the cache entry width {cache.shape[2]} "
                         "(kv_lora_rank + qk_rope_head_dim)")
    if not 0 < rank < width:
        raise ValueError(f"rank={rank} must lie inside the entry width {width}")
    if meta.block_size != cache.shape[1]:
        raise ValueError(f"meta.block_size={meta.block_size} differs from the cache's {cache.shape[1]}")
    if meta.num_tokens != q_abs.shape[0] or sum(meta.query_lens_cpu) != q_abs.shape[0]:
        raise ValueError(f"q_abs: {q_abs.shape[0]} tokens, but meta describes {meta.num_tokens}")
    if meta.positions.device != q_abs.device or meta.block_tables.device != q_abs.device:
        raise ValueError(f"meta tensors must be on {q_abs.device}")


def mla_decode_ref(q_abs: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                   rank: int) -> torch.Tensor:
    """Absorbed MLA: q_abs [T, H, R + P] -> [T, H, R] (q's dtype), float32 inside, one plain softmax."""
    check_mla_decode_args(q_abs, cache, meta, rank)
    num_tokens, num_heads, _ = q_abs.shape
    out = q_abs.new_empty((num_tokens, num_heads, rank))
    block_size = cache.shape[1]
    qsl = meta.query_start_loc.tolist()
    positions = meta.positions.tolist()
    for b in range(meta.num_seqs):
        for t in range(qsl[b], qsl[b + 1]):
            kv_pos = torch.arange(positions[t] + 1, device=q_abs.device)
            blocks = meta.block_tables[b, kv_pos // block_size].long()
            entries = cache[blocks, kv_pos % block_size].float()              # [ctx, R + P]
            scores = (q_abs[t].float() @ entries.T) * scale                   # [H, ctx]
            out[t] = (scores.softmax(-1) @ entries[:, :rank]).to(out.dtype)
    return out


def head_proj_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, H, K], weight [H, N, K] -> out [T, H, N] with out[t, h] = weight[h] @ x[t, h], float32 inside."""
    return torch.einsum("thk,hnk->thn", x.float(), weight.float()).to(x.dtype)
