"""Causal variable-length attention over the paged KV cache, batch-invariant by construction.

Each program handles one (sequence, query block, kv head): the GQA query heads of that kv head and up to
BLOCK_Q of the sequence's new tokens are packed into the BLOCK_M rows of the tile (row = token * GROUP +
head), so decode (one token) still feeds the tensor cores. Keys/values are read through the block table in
tiles of BLOCK_N absolute positions starting at position 0 — [0, BLOCK_N), [BLOCK_N, 2*BLOCK_N), ... —
with BLOCK_N a multiple of KV_CHUNK, and reduced with an fp32 online softmax in increasing tile order.

Why a token's output bits never depend on scheduling (prefill chunk, decode, prefix-cache hit, batch):
- the tile config (BLOCK_M, BLOCK_N, warps, stages) depends only on (GROUP, head_dim, dtype), so every call
  runs the same binary, and a row's arithmetic does not depend on which row of the tile it occupies;
- a row at position p sees the same tiles 0..p // BLOCK_N with the same masking (positions > p are -inf);
- tiles after p's tile, processed only because a later token of the same program needs them, leave the
  row's state unchanged exactly: the running max does not move (alpha is then exactly 1), p = exp2(-inf) = 0,
  and the P @ V product adds exact zeros;
- positions beyond the program's last query position are masked at load time, so unwritten cache slots
  (possibly NaN bits) never enter the arithmetic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from deepinfer.kernels._checks import is_power_of_two
from deepinfer.kernels.metadata import KV_CHUNK
from deepinfer.kernels.reference.attention import check_attention_args

if TYPE_CHECKING:
    from deepinfer.kernels.metadata import AttentionMetadata

__all__ = ["paged_attention", "attention_tile_config"]

_LOG2E = 1.4426950408889634
_PLAN_ATTR = "_paged_attention_plans"


def attention_tile_config(group: int, head_dim: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile config of the kernel: a function of the model shape only (never of the batch)."""
    block_m = max(64, triton.next_power_of_2(group))
    block_n = 64 if head_dim <= 128 else 32
    if dtype == torch.float32:
        block_n = 32
    num_stages = 3 if head_dim <= 128 and dtype != torch.float32 else 2
    assert block_n % KV_CHUNK == 0
    return {"BLOCK_M": block_m, "BLOCK_Q": block_m // group, "BLOCK_N": block_n,
            "num_warps": 4, "num_stages": num_stages}


# stride_bt (the padded block-table width) varies from step to step: keep it out of specialisation so every
# step runs the same binary.
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    plan_ptr, qsl_ptr, pos_ptr, bt_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr, KV_FP8: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(plan_ptr + 2 * pid)
    q_block = tl.load(plan_ptr + 2 * pid + 1)
    q_start = tl.load(qsl_ptr + seq)
    q_end = tl.load(qsl_ptr + seq + 1)

    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_start + tok < q_end)
    t = (q_start + tok).to(tl.int64)
    # Padding rows take position 0: finite arithmetic, never stored.
    q_pos = tl.load(pos_ptr + t, mask=row_ok, other=0).to(tl.int32)
    last_pos = tl.max(q_pos, axis=0)

    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    if KV_FP8:  # e4m3 cache: the head's key scale folds into the score scale, its value scale into the output
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
    for j in range(0, last_pos // BLOCK_N + 1):
        kv_pos = j * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_ok = kv_pos <= last_pos
        block = tl.load(bt_row + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        offset = kv_pos % BLOCK_SIZE
        k = tl.load(k_base + block[:, None] * stride_kb + offset[:, None] * stride_ks + d[None, :],
                    mask=kv_ok[:, None], other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)  # exact: every e4m3 value is a bf16/fp16/fp32 value
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(kv_pos[None, :] <= q_pos[:, None], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # An unchanged max must rescale by exactly 1 (not by a hardware exp2 approximation of 2^0), so tiles
        # that are fully masked for a row leave its state bit-identical.
        alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_new))
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + block[:, None] * stride_vb + offset[:, None] * stride_vs + d[None, :],
                    mask=kv_ok[:, None], other=0.0)
        if KV_FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None]
        if IEEE:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    out = acc / l_i[:, None]
    if KV_FP8:
        out = out * tl.load(v_scale_ptr + kv_head)
    tl.store(out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _build_plan(query_lens: list[int], seq_lens: list[int], block_q: int) -> list[int]:
    """Flattened (sequence, query block) pairs, heaviest first (longest KV range) for load balance."""
    work = []
    for seq, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for qb in range(triton.cdiv(q_len, block_q)):
            last = s_len - q_len + min((qb + 1) * block_q, q_len)
            work.append((-last, seq, qb))
    work.sort()
    return [x for _, seq, qb in work for x in (seq, qb)]


def _plan_tensor(meta: AttentionMetadata, block_q: int, device: torch.device) -> torch.Tensor:
    """The program -> (sequence, query block) map, cached on `meta` (one build per step, not per layer).

    A cached plan is reused only while meta's host-side lengths are unchanged, so a metadata object that is
    refilled in place for the next step gets a fresh plan.
    """
    lens = (list(meta.query_lens_cpu), list(meta.seq_lens_cpu))
    cache = getattr(meta, _PLAN_ATTR, None)
    key = (block_q, str(device))
    if cache is not None and key in cache and cache[key][0] == lens:
        return cache[key][1]
    plan = _build_plan(lens[0], lens[1], block_q)
    tensor = torch.tensor(plan, dtype=torch.int32).to(device)
    try:
        if cache is None:
            cache = {}
            setattr(meta, _PLAN_ATTR, cache)
        cache[key] = (lens, tensor)
    except AttributeError:  # a frozen/slotted metadata class: rebuild per call instead
        pass
    return tensor


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over the cache [num_blocks, block_size, Hkv, D] -> [T, Hq, D].

    The new token at absolute position p (meta.positions) of sequence b attends to positions [0, p] of b,
    read through meta.block_tables[b]; this step's keys/values must already be in the cache (`store_kv`).
    An e4m3 cache (kernels/kv_fp8.py) comes with float32 per-kv-head `k_scale` / `v_scale` [Hkv].
    """
    kv_fp8 = k_scale is not None
    check_attention_args(q, k_cache, v_cache, meta, kv_fp8=kv_fp8)
    num_tokens, num_q_heads, head_dim = q.shape
    if not is_power_of_two(head_dim) or not 16 <= head_dim <= 256:
        raise ValueError(f"q: head_dim {head_dim} unsupported (must be a power of two in [16, 256])")
    num_kv_heads = k_cache.shape[2]
    out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    group = num_q_heads // num_kv_heads
    cfg = attention_tile_config(group, head_dim, q.dtype)
    if meta.decode_plan is not None and meta.max_query_len == 1:
        plan = meta.decode_plan   # one query block per sequence whatever BLOCK_Q; no host work (graphs)
    else:
        plan = _plan_tensor(meta, cfg["BLOCK_Q"], q.device)
    bt = meta.block_tables
    _paged_attention_kernel[(plan.shape[0] // 2, num_kv_heads)](
        q, k_cache, v_cache, out,
        plan, meta.query_start_loc, meta.positions, bt,
        k_scale if kv_fp8 else q, v_scale if kv_fp8 else q,
        float(scale) * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), bt.stride(0),
        GROUP=group, BLOCK_Q=cfg["BLOCK_Q"], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], IEEE=q.dtype == torch.float32, KV_FP8=kv_fp8,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
