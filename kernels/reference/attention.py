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


# Token-key pairs x query heads x head_dim per piece of the batch: bounds the float32 temporaries of one
# piece (scores products, p*v) to ~16 MiB each. Tokens are independent, so the split changes no result.
_PIECE_ELEMENTS = 1 << 22
# A piece is closed before the key slots it reads exceed this many times those its tokens need.
_MAX_WASTE = 1.25


def _halving_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` (a power-of-two length) by repeatedly adding the upper half onto the lower half.

    The order is fixed by the length alone, and when only the first 2**j entries are non-zero the result
    equals the halving sum of those 2**j entries (each extra level adds exact zeros), so zero padding at
    the end never changes a bit.
    """
    n = x.shape[dim]
    while n > 1:
        n //= 2
        x = x.narrow(dim, 0, n) + x.narrow(dim, n, n)
    return x.squeeze(dim)


def _pieces(positions: list[int], budget_pairs: int) -> list[tuple[int, int, int]]:
    """Contiguous token ranges [a, b) and the key span (in chunks) each reads.

    A piece reads `tokens x span` key slots; it is closed before it outgrows the budget, or before the
    slots it reads exceed _MAX_WASTE times those its tokens need (a prefill run of rising positions
    would otherwise read a full square where it needs a triangle).
    """
    pieces: list[tuple[int, int, int]] = []
    a, top, need = 0, -1, 0
    for t, p in enumerate(positions):
        chunks_t = p // KV_CHUNK + 1
        new_top = max(top, p)
        used = (t + 1 - a) * (new_top // KV_CHUNK + 1)
        if t > a and (used * KV_CHUNK > budget_pairs or used > _MAX_WASTE * (need + chunks_t)):
            pieces.append((a, t, top // KV_CHUNK + 1))
            a, new_top, need = t, p, 0
        top, need = new_top, need + chunks_t
    if positions:
        pieces.append((a, len(positions), top // KV_CHUNK + 1))
    return pieces


def chunked_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant causal attention over the paged cache, float32 inside.

    For each query token: scores over its keys (one fixed-length dot product per key), the exact maximum
    over them, p = exp(score - max) on one fixed code path (masked keys give exactly 0), then the sums of
    p and p*v in a fixed tree: within each KV_CHUNK of positions aligned to absolute position 0 by halving
    (16 -> 8 -> 4 -> 2 -> 1), then across chunks by halving over the chunk count padded to a power of two.
    Keys past a token's position (and whole chunks past its context, present because another token of the
    batch reaches further) add exact zeros, so a token's output depends only on its own query and its own
    context: not on the batch, the prefill split or cache hits.

    Every step is a whole-batch tensor op (no Python loop over keys or chunks): a few dozen ops per call
    instead of ~50 per 16-key chunk. The batch is cut into pieces of contiguous tokens only to bound the
    temporaries; tokens are independent, so the cut changes nothing.

    An FP8 (e4m3) cache comes with per-kv-head float32 `k_scale` / `v_scale` [Hkv]: gathered entries are
    multiplied back elementwise (kernels/reference/kv_fp8.py), which keeps every property above.
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
    budget = max(KV_CHUNK, _PIECE_ELEMENTS // (num_q_heads * head_dim))
    outs = []
    for a, b, chunks in _pieces(pos.tolist(), budget):
        outs.append(_attend_piece(qf[a:b], pos[a:b], tables[a:b], k_flat, v_flat, block_size,
                                  chunks, scale, k_scale, v_scale))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(num_tokens, num_q_heads, head_dim).to(q.dtype)


def _attend_piece(qf: torch.Tensor, pos: torch.Tensor, tables: torch.Tensor, k_flat: torch.Tensor,
                  v_flat: torch.Tensor, block_size: int, chunks: int, scale: float,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """chunked_paged_attention for n tokens whose keys all lie in the first `chunks` chunks."""
    n, num_kv_heads, group, head_dim = qf.shape
    span = chunks * KV_CHUNK
    key_pos = torch.arange(span, dtype=torch.int64, device=qf.device)
    # Table entries past a sequence's blocks are padding (block 0): those keys are masked below.
    slots = (tables[:, key_pos // block_size] * block_size + key_pos % block_size).view(-1)  # [n*span]
    # index_select on whole rows: the same values as advanced indexing, several times faster on CPU.
    k = k_flat.index_select(0, slots).view(n, span, num_kv_heads, head_dim).to(torch.float32)
    v = v_flat.index_select(0, slots).view(n, span, num_kv_heads, head_dim).to(torch.float32)
    if k_scale is not None:  # FP8 cache: back to real values, per kv head
        k = k * k_scale.to(torch.float32).view(1, 1, num_kv_heads, 1)
        v = v * v_scale.to(torch.float32).view(1, 1, num_kv_heads, 1)
    scores = (qf.unsqueeze(1) * k.unsqueeze(3)).sum(-1) * scale                      # [n, span, Hkv, G]
    masked = (key_pos[None, :] > pos[:, None])[:, :, None, None]                     # [n, span, 1, 1]
    scores = scores.masked_fill(masked, float("-inf"))
    # Slots past the token's position may hold anything (stale or never-written memory, even NaN):
    # zero them so p == 0 there contributes exactly 0.
    v = v.masked_fill(masked, 0.0)
    m = scores.amax(dim=1, keepdim=True)                                             # exact; key 0 is real
    p = fixed_path(torch.exp, scores - m)                                            # masked keys -> 0
    pv = p.unsqueeze(-1) * v.unsqueeze(3)                                            # [n, span, Hkv, G, D]
    p_c = _halving_sum(p.view(n, chunks, KV_CHUNK, num_kv_heads, group), 2)          # [n, C, Hkv, G]
    pv_c = _halving_sum(pv.view(n, chunks, KV_CHUNK, num_kv_heads, group, head_dim), 2)
    width = 1 << (chunks - 1).bit_length()
    if width != chunks:  # zero chunks up to a power of two: exact zeros, see _halving_sum
        p_c = torch.cat([p_c, p_c.new_zeros((n, width - chunks, num_kv_heads, group))], dim=1)
        pv_c = torch.cat([pv_c, pv_c.new_zeros((n, width - chunks, num_kv_heads, group, head_dim))], dim=1)
    denom = _halving_sum(p_c, 1)                                                     # [n, Hkv, G]
    # + 0.0 turns a -0.0 sum into +0.0: padding zeros (+0.0) would do the same to some tokens but not
    # others, and a token's bits must not depend on its neighbours, not even the sign of a zero.
    acc = _halving_sum(pv_c, 1) + 0.0                                                # [n, Hkv, G, D]
    return acc / denom.unsqueeze(-1)


def check_attention_args(q, k_cache, v_cache, meta, kv_fp8: bool = False) -> None:
    """Shapes, dtypes and devices of an attention call; `kv_fp8`: the caches are e4m3 (with scales)."""
    check_tensor("q", q, ndim=3)
    kv_dtypes = (torch.float8_e4m3fn,) if kv_fp8 else (q.dtype,)
    check_tensor("k_cache", k_cache, ndim=4, device=q.device, dtypes=kv_dtypes)
    check_tensor("v_cache", v_cache, ndim=4, device=q.device, dtypes=kv_dtypes)
    if not kv_fp8:
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch reference: per sequence, gather its context through the block table and run causal
    softmax attention in fp32 (query at position p sees positions <= p). An e4m3 cache takes per-kv-head
    `k_scale` / `v_scale` [Hkv] (entries are multiplied back after the gather)."""
    check_attention_args(q, k_cache, v_cache, meta, kv_fp8=k_scale is not None)
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
        k = k_cache[blocks, kv_pos % block_size].float()                               # [ctx, Hkv, D]
        v = v_cache[blocks, kv_pos % block_size].float()
        if k_scale is not None:
            k, v = k * k_scale.float().view(1, -1, 1), v * v_scale.float().view(1, -1, 1)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)   # [ctx, Hq, D]
        qb = q[lo:hi].float()                                                          # [n, Hq, D]
        scores = torch.einsum("nhd,chd->hnc", qb, k) * scale
        allowed = kv_pos[None, :] <= meta.positions[lo:hi, None]                        # [n, ctx]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out[lo:hi] = torch.einsum("hnc,chd->nhd", scores.softmax(-1), v).to(q.dtype)
    return out
