"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache, in plain torch.

The cache holds, per token, the compressed latent c (kv_lora_rank values, already RMS-normed) followed by the
shared rope key k_pe (qk_rope_head_dim values, already rotated): [num_blocks, block_size, R + P]. Per head h,
kv_b_proj's rows [h*(N+V), (h+1)*(N+V)) hold W_UK[h] (N rows) then W_UV[h] (V rows), so that

    key_h = [W_UK[h] c ; k_pe]      value_h = W_UV[h] c
    score = scale * (q_nope_h . W_UK[h] c + q_pe_h . k_pe)
          = scale * ([W_UK[h]^T q_nope_h ; q_pe_h] . [c ; k_pe])

The second form ("absorbed") never decompresses keys: it is MQA with one key/value head of width R + P whose
values are the first R entries, followed by W_UV per head. `mla_attention_ref` is the plain reference (expand
the context to per-head K/V, or absorb for single-token decode rows); `chunked_mla_attention` is the
batch-invariant absorbed core the deterministic engine runs (keys reduced in KV_CHUNK-aligned chunks in a
fixed order, like `chunked_paged_attention`).
"""

from __future__ import annotations

import torch
from deepinfer.kernels._checks import check_same_dtype, check_tensor
from deepinfer.kernels.metadata import KV_CHUNK, AttentionMetadata
from deepinfer.kernels.reference.attention import token_seq_index
from deepinfer.kernels.reference.pointwise import fixed_path


def store_mla_ref(latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write latent [T, R] and k_pe [T, P] into cache [num_blocks, block_size, R + P] at flat slots [T].

    Negative slots are skipped (padding rows).
    """
    check_tensor("latent", latent, ndim=2, last_dim_contiguous=False)
    check_tensor("k_pe", k_pe, ndim=2, device=latent.device, last_dim_contiguous=False)
    check_tensor("cache", cache, ndim=3, device=latent.device)
    if latent.shape[0] != k_pe.shape[0] or latent.shape[1] + k_pe.shape[1] != cache.shape[2]:
        raise ValueError(f"latent {tuple(latent.shape)} + k_pe {tuple(k_pe.shape)} do not fill cache entries "
                         f"of width {cache.shape[2]}")
    if slot_mapping.shape[0] != latent.shape[0]:
        raise ValueError(f"slot_mapping: {slot_mapping.shape[0]} slots for {latent.shape[0]} tokens")
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = cache.shape[1]
    rank = latent.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    cache[blocks, offsets, :rank] = latent[keep].to(cache.dtype)
    cache[blocks, offsets, rank:] = k_pe[keep].to(cache.dtype)


def split_kv_b(kv_b_weight: torch.Tensor, num_heads: int, nope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj.weight [H*(N+V), R] -> (W_UK [H, N, R], W_UV [H, V, R]) as views."""
    rows, rank = kv_b_weight.shape
    if rows % num_heads or rows // num_heads <= nope_dim:
        raise ValueError(f"kv_b_proj weight {tuple(kv_b_weight.shape)} does not split into {num_heads} heads "
                         f"of {nope_dim} key rows plus value rows")
    w = kv_b_weight.view(num_heads, rows // num_heads, rank)
    return w[:, :nope_dim], w[:, nope_dim:]


def _check_mla_args(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                    meta: AttentionMetadata) -> None:
    check_tensor("q_nope", q_nope, ndim=3, last_dim_contiguous=False)
    check_tensor("q_pe", q_pe, ndim=3, device=q_nope.device, last_dim_contiguous=False)
    check_tensor("cache", cache, ndim=3, device=q_nope.device)
    check_same_dtype("cache", cache, q_nope.dtype)
    if q_pe.shape[:2] != q_nope.shape[:2]:
        raise ValueError(f"q_pe {tuple(q_pe.shape)} and q_nope {tuple(q_nope.shape)} differ in tokens/heads")
    if meta.block_size != cache.shape[1]:
        raise ValueError(f"meta.block_size={meta.block_size} differs from the cache's {cache.shape[1]}")
    if meta.num_tokens != q_nope.shape[0] or sum(meta.query_lens_cpu) != q_nope.shape[0]:
        raise ValueError(f"q: {q_nope.shape[0]} tokens, but meta describes {meta.num_tokens}")


def mla_attention_ref(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                      kv_b_weight: torch.Tensor, scale: float, absorb_decode: bool = True) -> torch.Tensor:
    """Plain MLA reference: q_nope [T, H, N], q_pe [T, H, P] -> per-head outputs [T, H, V], float32 inside.

    Per sequence, the context's latents are gathered through the block table. Rows of a sequence with more
    than one new token (prefill) expand the latents into per-head keys and values, as transformers does;
    a single-token (decode) row uses the absorbed form when `absorb_decode`, which computes the same values
    without materialising per-head keys. Query at position p sees positions <= p.
    """
    _check_mla_args(q_nope, q_pe, cache, meta)
    num_tokens, num_heads, nope = q_nope.shape
    rope = q_pe.shape[2]
    rank = cache.shape[2] - rope
    w_uk, w_uv = split_kv_b(kv_b_weight, num_heads, nope)
    w_uk, w_uv = w_uk.float(), w_uv.float()
    out = q_nope.new_empty((num_tokens, num_heads, w_uv.shape[1]))
    block_size = cache.shape[1]
    qsl = meta.query_start_loc.tolist()
    for b, ctx in enumerate(meta.seq_lens_cpu):
        lo, hi = qsl[b], qsl[b + 1]
        if hi == lo:
            continue
        kv_pos = torch.arange(ctx, device=q_nope.device)
        blocks = meta.block_tables[b, kv_pos // block_size].long()
        entries = cache[blocks, kv_pos % block_size].float()                      # [ctx, R + P]
        latent, k_pe = entries[:, :rank], entries[:, rank:]
        qn, qp = q_nope[lo:hi].float(), q_pe[lo:hi].float()                       # [n, H, N], [n, H, P]
        allowed = kv_pos[None, :] <= meta.positions[lo:hi, None]                  # [n, ctx]
        if hi - lo == 1 and absorb_decode:
            q_lat = torch.einsum("nhd,hdr->nhr", qn, w_uk)                        # [n, H, R]
            scores = torch.einsum("nhr,cr->hnc", q_lat, latent) + torch.einsum("nhp,cp->hnc", qp, k_pe)
            probs = (scores * scale).masked_fill(~allowed[None], float("-inf")).softmax(-1)
            o_lat = torch.einsum("hnc,cr->nhr", probs, latent)
            out[lo:hi] = torch.einsum("nhr,hvr->nhv", o_lat, w_uv).to(out.dtype)
        else:
            k_nope = torch.einsum("cr,hdr->chd", latent, w_uk)                    # [ctx, H, N]
            values = torch.einsum("cr,hvr->chv", latent, w_uv)                    # [ctx, H, V]
            scores = torch.einsum("nhd,chd->hnc", qn, k_nope) + torch.einsum("nhp,cp->hnc", qp, k_pe)
            probs = (scores * scale).masked_fill(~allowed[None], float("-inf")).softmax(-1)
            out[lo:hi] = torch.einsum("hnc,chv->nhv", probs, values).to(out.dtype)
    return out


def chunked_mla_attention(q_abs: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                          scale: float, rank: int) -> torch.Tensor:
    """Batch-invariant absorbed MLA core: q_abs [T, H, R + P] -> latent outputs [T, H, R] in q's dtype.

    q_abs is [W_UK^T q_nope ; q_pe] per head; keys are whole cache entries, values their first R = `rank`
    entries.
    As in `chunked_paged_attention`: keys are reduced in chunks of KV_CHUNK positions aligned to position 0,
    merged in increasing order by online-softmax rescaling, with fixed-order (pairwise-tree) sums over a
    chunk's keys and transcendentals on one fixed code path, so a token's result depends only on its own query
    and context, never on the batch, the prefill split or prefix-cache hits. float32 inside.
    """
    check_tensor("q_abs", q_abs, ndim=3, last_dim_contiguous=False)
    check_tensor("cache", cache, ndim=3, device=q_abs.device)
    num_tokens, num_heads, width = q_abs.shape
    _, block_size, cache_width = cache.shape
    if width != cache_width or not 0 < rank < width:
        raise ValueError(f"q_abs width {width} must equal the cache entry width {cache_width}, and "
                         f"rank={rank} lie inside it")
    if block_size % KV_CHUNK:
        raise ValueError(f"block_size={block_size} must be a multiple of KV_CHUNK={KV_CHUNK}")
    if num_tokens == 0:
        return q_abs.new_empty(q_abs.shape)
    dev = q_abs.device
    pos = meta.positions.to(torch.int64)
    tables = meta.block_tables.to(torch.int64)[token_seq_index(meta, dev)]       # [T, max_blocks]
    flat = cache.view(-1, cache_width)
    qf = q_abs.to(torch.float32)
    return _chunked_core(qf, flat, tables, pos, block_size, scale, rank).to(q_abs.dtype)


def _chunked_core(qf: torch.Tensor, flat: torch.Tensor, tables: torch.Tensor, pos: torch.Tensor,
                  block_size: int, scale: float, rank: int) -> torch.Tensor:
    """The chunk loop of `chunked_mla_attention`: float32 [T, H, rank] latent outputs."""
    num_tokens, num_heads, _ = qf.shape
    dev = qf.device
    m = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32, device=dev)
    denom = torch.zeros((num_tokens, num_heads), dtype=torch.float32, device=dev)
    acc = torch.zeros((num_tokens, num_heads, rank), dtype=torch.float32, device=dev)
    offsets = torch.arange(KV_CHUNK, dtype=torch.int64, device=dev)
    num_chunks = -(-(int(pos.max()) + 1) // KV_CHUNK)
    for c in range(num_chunks):
        start = c * KV_CHUNK
        idx = torch.nonzero(pos >= start).squeeze(1)                           # tokens reaching chunk c
        key_pos = start + offsets
        blocks = tables[idx, start // block_size].unsqueeze(1)
        slots = blocks * block_size + (start % block_size) + offsets            # [n, 16]
        kv = flat[slots].to(torch.float32)                                      # [n, 16, R + P]
        scores = (qf[idx].unsqueeze(1) * kv.unsqueeze(2)).sum(-1) * scale       # [n, 16, H]
        masked = key_pos[None, :] > pos[idx, None]                              # [n, 16]
        scores = scores.masked_fill(masked[:, :, None], float("-inf"))
        # Slots past the token's position may hold anything (stale or never-written memory, even NaN).
        values = kv[..., :rank].masked_fill(masked[:, :, None], 0.0)            # [n, 16, R]
        m_old = m[idx]
        m_new = torch.maximum(m_old, scores.amax(dim=1))
        alpha = fixed_path(torch.exp, m_old - m_new)
        p = fixed_path(torch.exp, scores - m_new.unsqueeze(1))                  # [n, 16, H]
        p_sum = _pairwise_sum(p)                                                # [n, H]
        pv = _pairwise_sum(p.unsqueeze(-1) * values.unsqueeze(2))               # [n, H, R]
        m[idx] = m_new
        denom[idx] = denom[idx] * alpha + p_sum
        acc[idx] = acc[idx] * alpha.unsqueeze(-1) + pv
    return acc / denom.unsqueeze(-1)


def _pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 1 (a chunk's KV_CHUNK keys) as a fixed pairwise tree of elementwise adds.

    The same tree for every token, whatever the batch: no reduction kernel whose split could vary, and
    log2(KV_CHUNK) tensor ops instead of KV_CHUNK.
    """
    while x.shape[1] > 1:
        x = x[:, 0::2] + x[:, 1::2]
    return x[:, 0]
