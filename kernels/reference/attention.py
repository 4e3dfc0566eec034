"""Paged causal attention in plain torch: the reference, and the batch-invariant chunked version.

`paged_attention_ref` is the one plain reference: the Triton kernel's tests compare against it and the
CPU fast path runs it. `chunked_paged_attention` is the CPU deterministic path (same chunk order as the
kernel's tiles, so a token's bits never depend on the batch). `check_attention_args` is shared by all.
"""

from __future__ import annotations

import torch
from deepinfer.kernels._checks import check_same_dtype, check_tensor
from deepinfer.kernels.metadata import KV_CHUNK, AttentionMetadata
from deepinfer.kernels.reference.pointwise import fixed_path


def token_seq_index(meta: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """int64 [T]: the batch index of the sequence each new token belongs to."""
    counts = torch.tensor(meta.query_lens_cpu, dtype=torch.int64, device=device)
    return torch.repeat_interleave(torch.arange(meta.num_seqs, device=device), counts)


def chunked_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Batch-invariant causal attention over the paged cache, float32 inside.

    Keys are reduced in chunks of KV_CHUNK positions aligned to absolute position 0, merged in increasing
    order by online-softmax rescaling. Every op a token goes through has a shape fixed by (chunk length,
    heads, head_dim), and elementwise transcendentals take one fixed code path, so a token's output depends
    only on its own query and its own context: not on the batch, the prefill split or cache hits. All query
    tokens are processed together; the loop is over chunk index only. Tokens whose context ends before a
    chunk skip it (their state would be unchanged anyway: chunk 0 always holds position 0).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if block_size % KV_CHUNK:
        raise ValueError(f"block_size={block_size} must be a multiple of KV_CHUNK={KV_CHUNK}")
    group = num_q_heads // num_kv_heads
    if num_tokens == 0:
        return q.new_empty(q.shape)
    dev = q.device
    pos = meta.positions.to(torch.int64)
    tables = meta.block_tables.to(torch.int64)[token_seq_index(meta, dev)]       # [T, max_blocks]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    qf = q.to(torch.float32).reshape(num_tokens, num_kv_heads, group, head_dim)

    m = torch.full((num_tokens, num_kv_heads, group), float("-inf"), dtype=torch.float32, device=dev)
    denom = torch.zeros((num_tokens, num_kv_heads, group), dtype=torch.float32, device=dev)
    acc = torch.zeros((num_tokens, num_kv_heads, group, head_dim), dtype=torch.float32, device=dev)
    offsets = torch.arange(KV_CHUNK, dtype=torch.int64, device=dev)
    num_chunks = -(-(int(pos.max()) + 1) // KV_CHUNK)
    for c in range(num_chunks):
        start = c * KV_CHUNK
        idx = torch.nonzero(pos >= start).squeeze(1)                           # tokens reaching chunk c
        key_pos = start + offsets                                               # [16]
        blocks = tables[idx, start // block_size].unsqueeze(1)
        slots = blocks * block_size + (start % block_size) + offsets            # [n, 16]
        k = k_flat[slots].to(torch.float32)                                     # [n, 16, Hkv, D]
        v = v_flat[slots].to(torch.float32)
        scores = (qf[idx].unsqueeze(1) * k.unsqueeze(3)).sum(-1) * scale        # [n, 16, Hkv, G]
        masked = key_pos[None, :] > pos[idx, None]                              # [n, 16]
        scores = scores.masked_fill(masked[:, :, None, None], float("-inf"))
        # Slots past the token's position may hold anything (stale or never-written memory, even NaN):
        # zero them so p == 0 there contributes exactly 0.
        v = v.masked_fill(masked[:, :, None, None], 0.0)
        m_old = m[idx]
        m_new = torch.maximum(m_old, scores.amax(dim=1))
        alpha = fixed_path(torch.exp, m_old - m_new)                         # 0 on the first chunk
        p = fixed_path(torch.exp, scores - m_new.unsqueeze(1))               # masked keys -> 0
        # Explicit sums over the 16 keys: a fixed order, no reduction kernel whose split could vary.
        p_sum = p[:, 0]
        pv = p[:, 0, :, :, None] * v[:, 0, :, None, :]
        for j in range(1, KV_CHUNK):
            p_sum = p_sum + p[:, j]
            pv = pv + p[:, j, :, :, None] * v[:, j, :, None, :]
        m[idx] = m_new
        denom[idx] = denom[idx] * alpha + p_sum
        acc[idx] = acc[idx] * alpha.unsqueeze(-1) + pv
    out = acc / denom.unsqueeze(-1)
    return out.reshape(num_tokens, num_q_heads, head_dim).to(q.dtype)


def check_attention_args(q, k_cache, v_cache, meta) -> None:
    check_tensor("q", q, ndim=3)
    check_tensor("k_cache", k_cache, ndim=4, device=q.device)
    check_tensor("v_cache", v_cache, ndim=4, device=q.device)
    check_same_dtype("k_cache", k_cache, q.dtype)
    check_same_dtype("v_cache", v_cache, q.dtype)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"k_cache: head_dim {cache_dim} differs from q's {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q: {num_q_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    if meta.block_size != block_size:
        raise ValueError(f"meta.block_size={meta.block_size} differs from k_cache's block size {block_size}")
    if meta.num_tokens != num_tokens:
        raise ValueError(f"q: {num_tokens} tokens, but meta describes {meta.num_tokens}")
    if len(meta.query_lens_cpu) != meta.num_seqs or sum(meta.query_lens_cpu) != num_tokens:
        raise ValueError(f"meta.query_lens_cpu {meta.query_lens_cpu} does not add up to {num_tokens} tokens")
    int_dtypes = (torch.int32, torch.int64)
    for name, ndim in (("query_start_loc", 1), ("positions", 1), ("block_tables", 2)):
        check_tensor(f"meta.{name}", getattr(meta, name), ndim=ndim, dtypes=int_dtypes, device=q.device)
    if meta.positions.stride(0) != 1 or meta.query_start_loc.stride(0) != 1:
        raise ValueError("meta.positions and meta.query_start_loc must be contiguous")
    if meta.query_start_loc.shape[0] != meta.num_seqs + 1 or meta.block_tables.shape[0] < meta.num_seqs:
        raise ValueError(
            f"meta: query_start_loc has {meta.query_start_loc.shape[0]} entries and block_tables "
            f"{meta.block_tables.shape[0]} rows for {meta.num_seqs} sequences"
        )


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Plain-torch reference: per sequence, gather its context through the block table and run causal
    softmax attention in fp32 (query at position p sees positions <= p)."""
    check_attention_args(q, k_cache, v_cache, meta)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    qsl = meta.query_start_loc.tolist()
    for b, ctx in enumerate(meta.seq_lens_cpu):
        lo, hi = qsl[b], qsl[b + 1]
        if hi == lo:
            continue
        kv_pos = torch.arange(ctx, device=q.device)
        blocks = meta.block_tables[b, kv_pos // block_size].long()
        k = k_cache[blocks, kv_pos % block_size].float().repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = v_cache[blocks, kv_pos % block_size].float().repeat_interleave(group, dim=1)
        qb = q[lo:hi].float()                                                          # [n, Hq, D]
        scores = torch.einsum("nhd,chd->hnc", qb, k) * scale
        allowed = kv_pos[None, :] <= meta.positions[lo:hi, None]                        # [n, ctx]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out[lo:hi] = torch.einsum("hnc,chd->nhd", scores.softmax(-1), v).to(q.dtype)
    return out
