"""Causal variable-length attention over the paged KV cache, batch-invariant by construction.

Each program handles one (sequence, query block, kv head): the GQA query heads of that kv head and up to
BLOCK_Q of the sequence's new tokens are packed into the BLOCK_M rows of the tile (row = token * GROUP +
head), so decode (one token) still feeds the tensor cores. Keys/values are read through the block table in
tiles of BLOCK_N absolute positions starting at position 0 — [0, BLOCK_N), [BLOCK_N, 2*BLOCK_N), ... —
with BLOCK_N a multiple of KV_CHUNK, and reduced with an fp32 online softmax in increasing tile order.
kernels/paged_attention_kernel.py is the kernel body: its FP16_KV form runs an e4m3 cache's products in
fp16 (exact for bf16 q), V_CVT converts an e4m3 value tile before it becomes an MMA operand, PREFETCH loads
the block ids a tile ahead so the key/value copies are double-buffered, DOT_SUM sums the softmax rows on the
tensor core (so decode and prefill programs may have different warps), and its
SWAP form (transposed tiles S^T = K Q^T, O^T += V^T P^T, the query rows the MMA's N dimension; what the
engine ran until 2026-12-02) stays for benchmarks/attn_variants.py to compare.

Why a token's output bits never depend on scheduling (prefill chunk, decode, prefix-cache hit, batch):
- the tile config (BLOCK_N, SWAP, FP16_KV, V_NAT, V_CVT, PREFETCH, DOT_SUM, warps, stages) depends only
  on (GROUP, head_dim, dtype, cache dtype) and whether the step is a decode step (one token per sequence,
  decode tiles of DECODE_BLOCK_M rows) or not; decode and prefill differ only in BLOCK_M, the stages (data
  movement) and, under DOT_SUM, the warps;
- a row's arithmetic does not depend on which row of the tile it occupies, nor on how many rows the tile
  has. In the untransposed tile (the engine's) BLOCK_M is the MMA's M: 16 or 32 rows compile to mma.sync
  (Triton's wgmma needs M % 64 == 0 and whole warpgroups of 4 warps), 64 rows of 4 warps to wgmma, and
  mma.sync and wgmma give different bits (measured on an H200). An element of S = Q K^T and of P @ V is
  one MMA chain over its row and column whatever the warps' layout; the row max is exact in any order; the
  row sum is not: a tl.sum follows the layout, so the tiles with plain row sums (a 16-bit cache with heads
  below 128) keep the same warps in decode (16 rows) and prefill (32), where Triton spreads a chained
  dot's warps along the keys for both (BLOCK_M < BLOCK_N), and groups of 64+ heads take one tile for both.
  Under DOT_SUM (the e4m3 cache's tiles and a 16-bit cache's 128-dim heads) the row sum is itself an MMA
  chain (p @ ones), so decode runs one-warp programs and prefill one- or two-warp ones, all mma.sync.
  (Under SWAP a query row is a column of S^T, so BLOCK_M is the MMA's N extent and 16 and 64 rows give
  the same bits.) tests/kernels/test_paged_attention_decode_gpu.py checks it on the GPU: decode steps
  vs every row of a full prefill, the last rows of random chunks, decode rows in mixed steps; random
  lengths, bf16 and e4m3;
- a row at position p sees the same tiles 0..p // BLOCK_N with the same masking (positions > p are -inf);
- tiles after p's tile, processed only because a later token of the same program needs them, leave the
  row's state unchanged exactly: the running max does not move (alpha is then exactly 1), p = exp2(-inf) = 0,
  and the P @ V product adds exact zeros;
- positions beyond the program's last query position are masked at load time, so unwritten cache slots
  (possibly NaN bits) never enter the arithmetic.
- split-KV (`attention_split_policy`; kernels/split_plan.py): a row at position >= SPLIT_FROM reduces its
  tiles in consecutive ranges fixed by its position and the shape only, each range from a fresh state (the
  same online softmax), and the ranges' states are merged in increasing order by split_combine's
  `merge_state`. A decode step runs each range in its own program and merges in kernels/split_combine.py
  (host plan, or the CUDA graphs' static plan); a prefill or mixed step's program runs a row's ranges one
  after another and merges as it goes (kernels/paged_attention_kernel.py; MERGE_IN_PLACE tiles, host plan
  or a prefill graph's static one), or, on the other tiles, runs split programs and the combine from a
  host plan (such steps never take a prefill graph). Both are the same arithmetic,
  so the argument above holds per range. A row below SPLIT_FROM takes one range: the arithmetic of the
  one-program form, which every step without a split row still launches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
from deepinfer.kernels._checks import is_power_of_two
from deepinfer.kernels.attention_plan import build_plan
from deepinfer.kernels.metadata import KV_CHUNK, plan_cached_on
from deepinfer.kernels.paged_attention_kernel import paged_attention_kernel as _paged_attention_kernel
from deepinfer.kernels.pdl import pdl_options
from deepinfer.kernels.reference.attention import check_attention_args
from deepinfer.kernels.split_combine import SplitLauncher
from deepinfer.kernels.split_plan import NO_SPLIT, SplitPolicy

if TYPE_CHECKING:
    from deepinfer.kernels.metadata import AttentionMetadata

__all__ = ["paged_attention", "attention_tile_config", "attention_split_policy", "build_plan",
           "launch_paged_attention"]

_LOG2E = 1.4426950408889634
# Chosen by benchmarks/attn_variants.py on an H200 (benchmarks/RESULTS.md). Untransposed tiles of 16 decode /
# 32 prefill rows, both mma.sync (2026-12-02 16:58 UTC), against the transposed wgmma tiles shipped before:
# 16-bit cache, 8B shape decode 185 -> 161 us at 256 x 640 positions (prefill of 16 x 512 tokens 274 -> 290),
# 0.5B 29.8 -> 25.9 us (87 -> 91); e4m3 cache with fp16 products under bf16 q and the value tile converted
# before it becomes an operand (V_CVT), 8B 158 -> 135 us (301 -> 330), 0.5B 32.2 -> 23.7 us (84 -> 97);
# then the block ids a tile ahead with 3 stages (PREFETCH, 2026-12-02 20:00 UTC): e4m3 8B 134 -> 121 us,
# 0.5B 22.4 -> 21.0 (prefill unchanged; no gain on a bf16 cache); then one-warp decode programs with the row
# sums through the tensor core (DOT_SUM, 2026-12-03): e4m3 8B 121 -> 106.5 us (16-key tiles, 4 stages;
# prefill 314 -> 317), 0.5B 20.7 -> 18.9 (32-key tiles; prefill 94.7 -> 89.3).
# Then wider prefill tiles under DOT_SUM and the DOT_SUM family on the 8B shape's bf16 cache (2026-12-03):
# e4m3 8B prefill 319 -> 242 us (one warp, 32 rows), 0.5B 89 -> 69 (two warps, 64 rows); bf16 8B decode
# 164 -> 162, prefill 286 -> 232. A bf16 cache with 64-dim heads keeps the plain tiles (no gain measured).
DECODE_BLOCK_M = 16
PREFILL_BLOCK_M = 32
# (e4m3 cache, head_dim == 128) -> (BLOCK_N, decode stages, prefill warps, prefill rows, prefill stages,
# split-KV by default (see SPLIT_FROM), stages of the split form's decode programs); prefill rows of these
# tiles split in programs of their own (MERGE_IN_PLACE 0, see SPLIT_FROM)
_DOT_SUM_TILES = {
    (True, True): (16, 4, 1, 32, 3, 1, 4),
    (True, False): (32, 3, 2, 64, 3, 1, 3),
    # 2 stages: at 3 the split form's one-warp decode tile spills inside its key loop (Triton 3.6)
    (False, True): (32, 3, 2, 64, 2, 0, 2),
}
_PLAN_ATTR = "_paged_attention_plans"
# Split-KV (kernels/split_plan.py): a row at position >= SPLIT_FROM reduces its keys in up to MAX_SPLITS
# ranges of whole tiles, merged in order. Below it a row keeps the one-program form and its bits (no
# benchmark shape reaches it: 256 x 512 -> 256 tops out at 768). What it buys is decode programs for long
# rows in small batches: a batch of 8 on a model with 2 kv heads is 16 programs on 132 SMs, each streaming
# its whole context alone. Measured on the H200 (benchmarks/RESULTS.md, 2026-12-05 02:40 and 05:30,
# benchmarks/attn_split.py): 1-16 long rows decode 2.2-6.9x faster, 64 rows at 2,048 positions 1.2-1.3x, a
# full batch (256 rows at 2,048) 0.92-1.07x. Prefill rows must split as decode rows do. The four-warp plain
# tiles (MERGE_IN_PLACE) reduce a row's ranges in one program and merge them there: 0.96-0.98x the unsplit
# prefill on a bf16 cache with 64-dim heads (the split programs cost 0.59-0.61x there), and a 64 x 4,096 ->
# 128 job on the 0.5B shape ran 8% faster than without split-KV. The one- and two-warp DOT_SUM tiles cannot
# hold the running merge's second accumulator (they spill, or at four warps ran at 0.40-0.51x), so their
# prefill rows keep the split programs and the combine (e4m3 caches: 0.78-0.95x; a 64 x 4,096 -> 128 job on
# the 8B shape's e4m3 cache ran 5% slower than without split-KV, H100, 2026-12-05). On by default (the tile
# config's SPLIT) where the split form compiled for sm_90 keeps its key loop free of spills; off for a
# 16-bit cache with 128-dim heads (the 8B shape), whose one-warp decode tile spills inside that loop at its
# 3 stages in the split form and not at 2 (RESULTS.md, 2026-12-04 19:20); forced on at 2 stages it shows
# the same trade (`split=` asks for it).
SPLIT_FROM = 1024
MAX_SPLITS = 8


def attention_tile_config(group: int, head_dim: int, dtype: torch.dtype, kv_fp8: bool = False,
                          decode: bool = False) -> dict[str, int]:
    """Tile config of the kernel: a function of the model shape, the cache dtype and whether the step is a
    decode step (one query token per sequence), never of the batch. Decode and prefill configs differ only
    where a row's arithmetic does not depend on it (the module docstring): BLOCK_M, the stages, and under
    DOT_SUM the warps."""
    rows = triton.next_power_of_2(group)
    sixteen_bit_q = dtype != torch.float32 and head_dim <= 128
    tiles = _DOT_SUM_TILES.get((kv_fp8, head_dim == 128)) if sixteen_bit_q else None
    if tiles is not None:
        # DOT_SUM families: one-warp decode programs (no barriers, no exchange between warps), prefill
        # programs of one or two warps; the row sums through the tensor core so the warps may differ;
        # mma.sync for all (at most two warps: wgmma needs whole warpgroups).
        block_n, dec_stages, pre_warps, pre_m, pre_stages, split, split_stages = tiles
        cfg = {"BLOCK_N": block_n, "DOT_SUM": 1, "PREFETCH": int(kv_fp8), "SPLIT": split,
               "SPLIT_DECODE_STAGES": split_stages,
               "FP16_KV": int(kv_fp8 and dtype == torch.bfloat16), "V_CVT": int(kv_fp8)}
        if decode and rows <= DECODE_BLOCK_M:
            block_m = DECODE_BLOCK_M
            cfg.update(num_warps=1, num_stages=dec_stages)
        else:   # wider groups decode in a tile of the group's rows; a warp per 32 rows, up to two
            block_m = rows if decode else max(pre_m, rows)
            warps = max(1 if decode else pre_warps, block_m // 32)
            cfg.update(num_warps=min(2, warps), num_stages=pre_stages)
    elif sixteen_bit_q:   # 16-bit cache, heads below 128: plain row sums, see the module docstring
        block_n = 64 if head_dim == 128 else 128
        block_m = max(PREFILL_BLOCK_M, rows)
        if decode and block_m == PREFILL_BLOCK_M:
            block_m = max(DECODE_BLOCK_M, rows)
        # Past mma.sync's reach (a group of 64+ heads) decode takes the prefill tile itself.
        cfg = {"BLOCK_N": block_n, "num_stages": 2, "num_warps": 4, "PREFETCH": 0, "DOT_SUM": 0, "SPLIT": 1,
               "FP16_KV": 0, "V_CVT": 0}
    else:          # float32 (the CPU interpreter) and head_dim > 128
        block_m = max(64, rows)
        cfg = {"BLOCK_N": 32, "num_stages": 2, "num_warps": 4, "SPLIT": 1, "FP16_KV": 0, "V_CVT": 0,
               "PREFETCH": 0, "DOT_SUM": 0}
    assert cfg["BLOCK_N"] % KV_CHUNK == 0
    # Prefill split rows merged in their own program: only where the tile has four warps to hold the second
    # accumulator, i.e. not the one- and two-warp DOT_SUM tiles (see SPLIT_FROM).
    cfg["MERGE_IN_PLACE"] = int(not cfg["DOT_SUM"])
    return {"BLOCK_M": block_m, "BLOCK_Q": block_m // group, "SWAP": 0, "V_NAT": 0, **cfg}


def attention_split_policy(cfg: dict[str, int]) -> SplitPolicy:
    """The split-KV layout of a tile config: rows at positions >= SPLIT_FROM split into ranges of at least
    SPLIT_FROM // BLOCK_N tiles, at most MAX_SPLITS of them; NO_SPLIT where the config's SPLIT is 0 (see
    SPLIT_FROM). Decode and prefill configs of one shape share BLOCK_N and SPLIT, so they share the layout:
    a function of the model shape and the row's position only."""
    if not cfg.get("SPLIT", 0):
        return NO_SPLIT
    return SplitPolicy(min_tiles=max(1, SPLIT_FROM // cfg["BLOCK_N"]), max_splits=MAX_SPLITS)


def _needs_split(meta: AttentionMetadata, policy: SplitPolicy, block_n: int) -> bool:
    """Whether the step has a row with several splits. A CUDA-graph step's host lengths are placeholders:
    its capture decided (meta.split_kv); otherwise the longest row decides (split counts grow with the
    position)."""
    first = policy.split_from(block_n)
    if first is None:
        return False
    if meta.static_decode or meta.static_prefill:
        return meta.split_kv
    return max(meta.seq_lens_cpu, default=0) - 1 >= first


def _plan_tensor(meta: AttentionMetadata, block_q: int, device: torch.device) -> torch.Tensor:
    """The program -> (sequence, query block) map, cached on `meta` (metadata.plan_cached_on)."""
    def build(q_lens: list[int], s_lens: list[int]) -> torch.Tensor:
        t = torch.from_numpy(build_plan(q_lens, s_lens, block_q))
        return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t

    return plan_cached_on(meta, _PLAN_ATTR, (block_q, str(device)), build)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    split: SplitPolicy | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over the cache [num_blocks, block_size, Hkv, D] -> [T, Hq, D].

    The new token at absolute position p (meta.positions) of sequence b attends to positions [0, p] of b,
    read through meta.block_tables[b]; this step's keys/values must already be in the cache (`store_kv`).
    An e4m3 cache (kernels/kv_fp8.py) comes with float32 per-kv-head `k_scale` / `v_scale` [Hkv].
    `split`: the split-KV layout (default `attention_split_policy` of the shape's tiles; tests pass small
    ones). Keep it fixed for batch invariance: a row's bits depend on it.
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
    decode = meta.max_query_len == 1
    cfg = attention_tile_config(group, head_dim, q.dtype, kv_fp8=kv_fp8, decode=decode)
    policy = split if split is not None else attention_split_policy(cfg)
    return launch_paged_attention(q, k_cache, v_cache, meta, scale, k_scale, v_scale, cfg, out, policy)


def launch_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None,
                           v_scale: torch.Tensor | None, cfg: dict[str, int],
                           out: torch.Tensor | None = None, split: SplitPolicy | None = None) -> torch.Tensor:
    """Run the kernel with an explicit tile config (`attention_tile_config`'s keys) and split-KV layout (None:
    never split); arguments as checked by `paged_attention`. benchmarks/attn_variants.py times configs
    through this."""
    num_tokens, num_q_heads, head_dim = q.shape
    if out is None:
        out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    merge: dict[str, object] = {}
    if split is not None and _needs_split(meta, split, cfg["BLOCK_N"]):
        if meta.static_prefill and not cfg.get("MERGE_IN_PLACE", 0):
            # the split programs are planned from the rows' lengths, which a captured step does not have
            raise ValueError("a CUDA-graph prefill step with split rows needs a tile config with "
                             "MERGE_IN_PLACE (runner/prefill_graphs.py sends such steps down the eager path)")
        if meta.max_query_len == 1 or not cfg.get("MERGE_IN_PLACE", 0):   # a program per split, the combine
            launch = _SplitLaunch(q, k_cache, v_cache, meta, scale, k_scale, v_scale, cfg, out, split)
            if meta.static_decode:
                launch.static_decode(meta.decode_plan)
            else:
                launch.host_planned()
            return out
        # a prefill or mixed step: each program merges its rows' ranges itself (the kernel's docstring)
        merge = {"MIN_TILES": split.min_tiles, "MAX_SPLITS": split.max_splits, "MERGE_IN_PLACE": True}
    if meta.static_decode:
        plan = meta.decode_plan   # one query block per sequence whatever BLOCK_Q; no host work (graphs)
    elif meta.static_prefill:
        if meta.plan_block_q != cfg["BLOCK_Q"]:   # a plan of other query blocks would skip or repeat tokens
            raise ValueError(f"meta.prefill_plan was built for BLOCK_Q={meta.plan_block_q}, the tile config "
                             f"has BLOCK_Q={cfg['BLOCK_Q']}")
        plan = meta.prefill_plan   # static (a CUDA-graph prefill step): no host work
    else:
        plan = _plan_tensor(meta, cfg["BLOCK_Q"], q.device)
    _launch((plan.shape[0] // 2, k_cache.shape[2]), q, k_cache, v_cache, meta, scale, k_scale, v_scale, cfg,
            out, plan, **merge)
    return out


def _launch(grid: tuple[int, ...], q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
            cfg: dict[str, int], out: torch.Tensor, plan: torch.Tensor, **split_args: object) -> None:
    """One launch of the kernel: the one-program form, or with `split_args` the split form."""
    kv_fp8 = k_scale is not None
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    bt = meta.block_tables
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out,
        plan, meta.query_start_loc, meta.positions, bt,
        k_scale if kv_fp8 else q, v_scale if kv_fp8 else q,
        float(scale) * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), bt.stride(0),
        GROUP=num_q_heads // k_cache.shape[2], BLOCK_Q=cfg["BLOCK_Q"], BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        IEEE=q.dtype == torch.float32, KV_FP8=kv_fp8, SWAP=cfg["SWAP"], FP16_KV=cfg["FP16_KV"] and kv_fp8,
        V_NAT=int(bool(cfg.get("V_NAT", 0) and cfg["SWAP"])), V_CVT=int(bool(cfg.get("V_CVT", 0) and kv_fp8)),
        PREFETCH=int(bool(cfg.get("PREFETCH", 0) and not cfg["SWAP"])),
        DOT_SUM=int(bool(cfg.get("DOT_SUM", 0) and not cfg["SWAP"])),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **split_args, **pdl_options(q.device),
    )


class _SplitLaunch(SplitLauncher):
    """The split programs' launches (kernels/split_combine.py holds the plan-driven sequences)."""

    def __init__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None, cfg: dict[str, int], out: torch.Tensor,
                 policy: SplitPolicy) -> None:
        if cfg["SWAP"]:
            raise ValueError("split-KV runs the untransposed tile (SWAP=0)")
        self.q, self.meta, self.out, self.policy = q, meta, out, policy
        self.k_cache, self.v_cache, self.scale, self.k_scale, self.cfg = k_cache, v_cache, scale, k_scale, cfg
        self.num_heads, self.width = q.shape[1], q.shape[2]
        self.block_q, self.block_n = cfg["BLOCK_Q"], cfg["BLOCK_N"]
        self.head_blocks = k_cache.shape[2]
        self.v_scale, self.group = v_scale, q.shape[1] // k_cache.shape[2]

    def _split(self, grid: tuple[int, int, int], part: torch.Tensor, ml: torch.Tensor, plan: torch.Tensor,
               soff: torch.Tensor, slot_base: int, fixed_slots: bool) -> None:
        one_token = self.meta.max_query_len == 1
        cfg = self.cfg
        if one_token and "SPLIT_DECODE_STAGES" in cfg:   # data movement only: the same bits
            cfg = dict(cfg, num_stages=cfg["SPLIT_DECODE_STAGES"])
        _launch(grid, self.q, self.k_cache, self.v_cache, self.meta, self.scale, self.k_scale, self.v_scale,
                cfg, self.out, plan, part_ptr=part, ml_ptr=ml, soff_ptr=soff, slot_base=slot_base,
                num_heads=self.num_heads, MIN_TILES=self.policy.min_tiles, MAX_SPLITS=self.policy.max_splits,
                FIXED_SLOTS=fixed_slots, ONE_TOKEN=one_token)
