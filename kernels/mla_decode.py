"""MLA attention in the absorbed form over the paged latent cache (Triton), split-KV, batch-invariant.

Input per new token and head: q_abs = [W_UK^T q_nope ; q_pe] (kv_lora_rank R + qk_rope_head_dim P values).
The cache [num_blocks, block_size, R + P] holds per position the latent c and the rope key k_pe, so every
head attends one shared key [c ; k_pe] and one shared value c (MQA of width R + P): score = q_abs . entry,
out_lat = softmax(scores) @ c. The caller applies W_UV afterwards (see `head_proj`).

Tiling: a program covers one (sequence, query block) of the plan, GROUP heads of it and one KV split; its
BLOCK_M rows are (token, head) pairs (row = token * GROUP + head), so a decode token's heads fill the tile.
Keys are read through the block table in tiles of BLOCK_N absolute positions from position 0, and each
tile is loaded once and used as key (latent + rope part) and value (latent part).

Split-KV, batch-invariant: a row at position p has n_tiles = p // BLOCK_N + 1 tiles, split into
n_splits(p) consecutive ranges of tiles_per_split(p) = max(min_tiles, ceil(n_tiles / max_splits)) tiles —
a function of the row's own position and the `SplitPolicy` only. Split s reduces its tiles in increasing
order with an fp32 online softmax; a row with several splits leaves (acc, max, sum) per split in a scratch
buffer and `_mla_combine_kernel` merges them in increasing split order. Because a row takes the same tiles,
the same split boundaries and the same merge order whether it is decoded alone, decoded in a batch, or
computed as part of a prefill chunk, its bits never depend on scheduling — provided the policy is fixed
(deterministic mode uses `DETERMINISTIC_SPLITS` always). Tiles a program processes for its other rows
leave a row's state unchanged exactly (as in paged_attention: alpha is exactly 1 when the max does not
move, p = exp2(-inf) = 0, P @ V adds exact zeros), and positions beyond the program's last query position
are masked at load time, so unwritten slots (NaN bits) never enter the arithmetic.

Launch plans (kernels/mla_decode_plan.py): the host plan, built from the step's host lengths, serves any
step; a decode step given `meta.decode_plan` (CUDA graphs) takes the static decode plan, whose launches
depend on the number of tokens and the policy only. Both run the same programs per token with the same
arithmetic; only the split axis' extent and the scratch addresses differ, so the bits are the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from deepinfer.kernels._checks import check_tensor, is_power_of_two, num_sms
from deepinfer.kernels.mla_proj import head_proj
from deepinfer.kernels.reference.mla_decode import check_mla_decode_args
from deepinfer.kernels.split_combine import SplitLauncher, split_layout
from deepinfer.kernels.split_plan import DETERMINISTIC_SPLITS, NO_SPLIT, SplitPolicy

if TYPE_CHECKING:
    from deepinfer.kernels.metadata import AttentionMetadata

__all__ = ["SplitPolicy", "DETERMINISTIC_SPLITS", "NO_SPLIT", "mla_tile_config", "mla_decode",
           "head_proj", "fast_split_policy"]

_LOG2E = 1.4426950408889634


def mla_tile_config(num_heads: int, rank: int, rope_dim: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile config: a function of the model shape only (never of the batch)."""
    group = min(num_heads, 16)
    block_m = 16
    return {"GROUP": group, "BLOCK_Q": block_m // group, "BLOCK_M": block_m,
            "BLOCK_N": 16 if dtype == torch.float32 else 32,
            "BLOCK_P": max(16, triton.next_power_of_2(rope_dim)), "BLOCK_H": 16,
            "num_warps": 4, "num_stages": 2}


def fast_split_policy(meta: AttentionMetadata, num_heads: int, device: torch.device) -> SplitPolicy:
    """Fast (not batch-invariant) mode: split decode steps whose programs would not fill the GPU.

    Chosen from `meta.num_seqs`: in a CUDA-graph decode step that is the bucket size (padding rows
    included), so the graph's launches stay fixed per bucket, and a graph step splits as an eager step of
    that many rows would. Fast mode promises no batch invariance (its GEMMs are cuBLAS, whose algorithm
    depends on M too), so a graph step need not equal the eager step of its real rows bit for bit."""
    if meta.max_query_len != 1 or device.type != "cuda":
        return NO_SPLIT
    programs = meta.num_seqs * triton.cdiv(num_heads, 16)
    sms = num_sms(device)
    if programs >= sms:
        return NO_SPLIT
    return SplitPolicy(min_tiles=4, max_splits=min(16, triton.cdiv(2 * sms, programs)))


@triton.jit(do_not_specialize=["stride_bt", "slot_base", "num_heads"])
def _mla_split_kernel(
    q_ptr, cache_ptr, out_ptr, part_ptr, ml_ptr,
    plan_ptr, qsl_ptr, pos_ptr, bt_ptr, soff_ptr,
    qk_scale, slot_base, num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_bt,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    MIN_TILES: tl.constexpr, MAX_SPLITS: tl.constexpr, IEEE: tl.constexpr, FIXED_SLOTS: tl.constexpr,
):
    pid = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(plan_ptr + 2 * pid)
    q_block = tl.load(plan_ptr + 2 * pid + 1)
    q_start = tl.load(qsl_ptr + seq)
    q_end = tl.load(qsl_ptr + seq + 1)

    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GROUP
    head = head_block * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_start + tok < q_end) & (head < num_heads)
    t = (q_start + tok).to(tl.int64)
    q_pos = tl.load(pos_ptr + t, mask=row_ok, other=0).to(tl.int32)
    # The row's split layout, from its own position only.
    n_tiles, per_split, n_splits = split_layout(q_pos, BLOCK_N, MIN_TILES, MAX_SPLITS)
    active = row_ok & (split < n_splits)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, n_tiles)
    tile_lo = tl.min(tl.where(active, lo, 1 << 30), axis=0)
    tile_hi = tl.max(tl.where(active, hi, 0), axis=0)
    last_pos = tl.max(tl.where(active, q_pos, 0), axis=0)

    r = tl.arange(0, RANK)
    pe = tl.arange(0, BLOCK_P)
    pe_ok = pe < ROPE
    q_row = q_ptr + t[:, None] * stride_qt + head[:, None].to(tl.int64) * stride_qh
    q_lat = tl.load(q_row + r[None, :], mask=active[:, None], other=0.0)
    q_pe = tl.load(q_row + RANK + pe[None, :], mask=active[:, None] & pe_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, RANK], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for j in range(tile_lo, tile_hi):
        kv_pos = j * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_ok = kv_pos <= last_pos
        block = tl.load(bt_row + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        entry = cache_ptr + block * stride_cb + (kv_pos % BLOCK_SIZE).to(tl.int64) * stride_cs
        lat = tl.load(entry[:, None] + r[None, :], mask=kv_ok[:, None], other=0.0)
        kpe = tl.load(entry[:, None] + RANK + pe[None, :], mask=kv_ok[:, None] & pe_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q_lat, tl.trans(lat), input_precision="ieee")
            s = tl.dot(q_pe, tl.trans(kpe), s, input_precision="ieee")
        else:
            s = tl.dot(q_lat, tl.trans(lat))
            s = tl.dot(q_pe, tl.trans(kpe), s)
        mine = active & (j >= lo) & (j < hi)
        ok = mine[:, None] & (kv_pos[None, :] <= q_pos[:, None])
        s = tl.where(ok, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # An unchanged max rescales by exactly 1, so tiles masked for a row leave its state bit-identical;
        # a row with no key yet (max still -inf) subtracts 0, giving p = 0 instead of NaN.
        alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_new))
        p = tl.exp2(s - tl.where(m_new == float("-inf"), 0.0, m_new)[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if IEEE:
            acc = tl.dot(p.to(lat.dtype), lat, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(lat.dtype), lat, acc)
        m_i = m_new
    single = active & (n_splits == 1)
    out = acc / tl.where(single, l_i, 1.0)[:, None]
    tl.store(out_ptr + t[:, None] * stride_ot + head[:, None].to(tl.int64) * stride_oh + r[None, :],
             out.to(out_ptr.dtype.element_ty), mask=single[:, None])
    multi = active & (n_splits > 1)
    # Where the partial goes changes no arithmetic: the static decode plan's fixed slot, or the host plan's.
    if FIXED_SLOTS:
        slot = t * MAX_SPLITS - slot_base + split
    else:
        slot = tl.load(soff_ptr + t, mask=multi, other=0) - slot_base + split
    part = slot * num_heads + head
    tl.store(part_ptr + part[:, None] * RANK + r[None, :], acc, mask=multi[:, None])
    tl.store(ml_ptr + 2 * part, m_i, mask=multi)
    tl.store(ml_ptr + 2 * part + 1, l_i, mask=multi)


def mla_decode(q_abs: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float, rank: int,
               policy: SplitPolicy = DETERMINISTIC_SPLITS) -> torch.Tensor:
    """Absorbed MLA: q_abs [T, H, R + P] over the latent cache [blocks, block_size, R + P] -> [T, H, R].

    Causal: the token at position p of sequence b attends to positions [0, p] of b through
    meta.block_tables[b] (this step's entries must already be in the cache). Any mix of prefill and decode
    rows. `policy` fixes the split-KV layout; keep it constant (DETERMINISTIC_SPLITS) for batch
    invariance. Output in q_abs's dtype, fp32 accumulation.

    With `meta.decode_plan` (a decode step of one token per sequence, as CUDA-graph steps give) the launches
    come from the static decode plan, which never reads the host lengths (kernels/mla_decode_plan.py): the
    same bits as the host plan, whose launches depend on every row's position.
    """
    check_mla_decode_args(q_abs, cache, meta, rank)
    num_tokens, num_heads, width = q_abs.shape
    rope = width - rank
    if not is_power_of_two(rank) or rank < 16:
        raise ValueError(f"rank={rank}: kv_lora_rank must be a power of two >= 16 for the Triton kernel")
    if rope > 256:
        raise ValueError(f"qk_rope_head_dim={rope}: at most 256 supported")
    check_tensor("cache", cache, ndim=3, device=q_abs.device)
    if cache.stride(2) != 1:
        raise ValueError("cache: entries must be contiguous (stride 1 along the last dim)")
    out = torch.empty((num_tokens, num_heads, rank), dtype=q_abs.dtype, device=q_abs.device)
    if num_tokens == 0:
        return out
    launch = _Launch(q_abs, cache, meta, out, scale, rank, policy)
    if meta.static_decode:
        launch.static_decode(meta.decode_plan)
    else:
        launch.host_planned()
    return out


class _Launch(SplitLauncher):
    """The MLA split kernel's launch (kernels/split_combine.py holds the launch sequences and the combine)."""

    def __init__(self, q_abs: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor,
                 scale: float, rank: int, policy: SplitPolicy) -> None:
        self.q, self.cache, self.meta, self.out = q_abs, cache, meta, out
        self.scale, self.width, self.policy = scale, rank, policy
        self.num_heads = q_abs.shape[1]
        self.cfg = mla_tile_config(self.num_heads, rank, q_abs.shape[2] - rank, q_abs.dtype)
        self.block_q, self.block_n = self.cfg["BLOCK_Q"], self.cfg["BLOCK_N"]
        self.head_blocks = triton.cdiv(self.num_heads, self.cfg["GROUP"])
        self.combine_heads = self.cfg["BLOCK_H"]

    def _split(self, grid: tuple[int, int, int], part: torch.Tensor, ml: torch.Tensor, plan: torch.Tensor,
               soff: torch.Tensor, slot_base: int, fixed_slots: bool) -> None:
        q, cache, out, meta, cfg, policy = self.q, self.cache, self.out, self.meta, self.cfg, self.policy
        bt = meta.block_tables
        _mla_split_kernel[grid](
            q, cache, out, part, ml,
            plan, meta.query_start_loc, meta.positions, bt, soff,
            float(self.scale) * _LOG2E, slot_base, self.num_heads,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            cache.stride(0), cache.stride(1), bt.stride(0),
            GROUP=cfg["GROUP"], BLOCK_Q=cfg["BLOCK_Q"], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
            RANK=self.width, ROPE=q.shape[2] - self.width, BLOCK_P=cfg["BLOCK_P"], BLOCK_SIZE=cache.shape[1],
            MIN_TILES=policy.min_tiles, MAX_SPLITS=policy.max_splits, IEEE=q.dtype == torch.float32,
            FIXED_SLOTS=fixed_slots, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
