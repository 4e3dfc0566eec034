"""Paged causal attention in plain torch: a batch-invariant chunked version and a simple gathered one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention_metadata import KV_CHUNK, AttentionMetadata
from .pointwise import fixed_path


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


def gathered_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Plain causal attention: per sequence, gather its cached K/V and run SDPA with a position mask."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    pos = meta.positions.to(torch.int64)
    start = 0
    for b, (q_len, ctx_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if q_len == 0:
            continue
        end = start + q_len
        key_pos = torch.arange(ctx_len, device=q.device)
        blocks = meta.block_tables[b].to(torch.int64)[key_pos // block_size]
        slots = blocks * block_size + key_pos % block_size
        k = k_flat[slots].repeat_interleave(group, dim=1).transpose(0, 1)        # [Hq, ctx, D]
        v = v_flat[slots].repeat_interleave(group, dim=1).transpose(0, 1)
        mask = key_pos[None, :] <= pos[start:end, None]                         # [q_len, ctx]
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1), k, v, attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1)
        start = end
    return out
