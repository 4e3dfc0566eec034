"""Tile configs of the block-scaled FP8 GEMM (kernels/fp8_matmul.py `block_matmul`) by M bucket, proven
bitwise equal on the device before use, and the entry points the engine calls.

Configs are named as the sweep prints them (benchmarks/fp8_sweep.py): "BMxBNxBK wW sS" plus " k1" (K loop
1), " tma" (TMA tile loads) and " persN" (persistent, N programs per SM), e.g. "64x128x128 w4 s3 tma";
`parse_config` / `config_name` convert. `BLOCK_BUCKET_TABLE` maps a weight-shape class to (max_m, name)
buckets: plain data, so a GPU sweep's table (`python3 benchmarks/bench_fp8.py --skip-gemm --skip-e2e
--sweep --sweep-kernels block ...` prints it ready to paste) replaces it without code changes.

Batch invariance: every config keeps BLOCK_K = 128 (one dot per weight K-block) and the K loop 0/1 order,
so an output element is the same chain of (dot, scale, FMA) steps in each; which program, tile shape and
loader computes it must not change its bits, which the device proves (`BlockPlanner`, the scheme of
kernels/bucket_planner.py): per weight shape, probe rows through every bucket config, each also with
pointer loads and without the per-tile weight scale, and through the reference config (`REFERENCE`,
today's single config), all bitwise equal, or that shape keeps `REFERENCE` for every M. Fast mode picks
the bucket for its M with no proof.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from deepinfer.kernels._checks import check_tensor
from deepinfer.kernels.bucket_planner import BucketPlanner, bucket_for, outputs_agree, probe_rows
from deepinfer.kernels.fp8_matmul import _check_weight, block_matmul, quantize_act
from deepinfer.kernels.reference.fp8_matmul import FP8_DTYPE

__all__ = ["parse_config", "config_name", "REFERENCE", "BLOCK_BUCKET_TABLE", "BLOCK_SWEEP_CANDIDATES",
           "BLOCK_TABLE_ENV", "load_block_table", "shape_class", "block_buckets", "block_tile_config",
           "BlockPlanner", "block_linear", "block_linear_quantized"]

Table = Mapping[str, Sequence[tuple[int | None, str]]]

_NAME = re.compile(r"^(\d+)x(\d+)x(\d+) w(\d+) s(\d+)((?: k1| tma| pers\d+| cols)*)$")


def parse_config(name: str) -> dict[str, int]:
    """The launch config a name stands for; ValueError for a malformed one."""
    m = _NAME.match(name.strip())
    if not m:
        raise ValueError(f"block config {name!r}: expected 'BMxBNxBK wW sS' [k1] [tma] [persN] [cols]")
    bm, bn, bk, warps, stages = (int(v) for v in m.groups()[:5])
    flags = m.group(6).split()
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps,
           "num_stages": stages, "K_LOOP": 1 if "k1" in flags else 0}
    if "tma" in flags:
        cfg["TMA"] = 1
    pers = [f for f in flags if f.startswith("pers")]
    if pers:
        if "tma" not in flags:
            raise ValueError(f"block config {name!r}: the persistent loop needs TMA loads")
        cfg["PERSISTENT"] = int(pers[0][4:])
    if "cols" in flags:   # per-column weight scales even where one per tile would do (sweep comparisons)
        cfg["COL_SCALES"] = 1
    return cfg


def config_name(cfg: dict[str, int]) -> str:
    """The name of a launch config (inverse of `parse_config`)."""
    name = (f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']} "
            f"s{cfg['num_stages']}")
    name += " k1" if cfg.get("K_LOOP", 0) == 1 else ""
    name += " tma" if cfg.get("TMA") else ""
    name += f" pers{cfg['PERSISTENT']}" if cfg.get("PERSISTENT") else ""
    return name + (" cols" if cfg.get("COL_SCALES") else "")


# Today's single batch-invariant config (pointer loads; kernels/fp8_matmul.fp8_tile_config): what every M
# runs where the buckets are not proven, and what the proof compares the buckets against.
REFERENCE = "64x128x128 w4 s3"

# (max_m, config name) by ascending M per weight-shape class (`shape_class`), the last bucket open-ended.
# From the block sweep on the H200 (2026-12-02, benchmarks/RESULTS.md: `bench_fp8.py --skip-gemm
# --skip-e2e --sweep --sweep-kernels block --sweep-budget-s 170`): per class and M bucket the fastest
# candidate over the class's 8B shapes, every candidate bitwise equal to REFERENCE at every M swept.
BLOCK_BUCKET_TABLE: dict[str, tuple[tuple[int | None, str], ...]] = {
    "default": ((1, "64x128x128 w4 s3 tma pers2"), (16, "64x64x128 w4 s4 tma"), (64, "64x32x128 w4 s6 tma"),
                (128, "64x64x128 w4 s4 tma"), (256, "64x128x128 w4 s3 tma"), (None, "64x128x128 w4 s4 tma")),
    "wide": ((256, "64x128x128 w4 s4 tma"), (None, "128x128x128 w8 s4 tma")),
    "long_k": ((16, "64x64x128 w4 s6 tma"), (64, "64x32x128 w4 s6 tma"), (128, "64x64x128 w4 s6 tma"),
               (256, "64x128x128 w4 s4 tma"), (2048, "128x128x128 w8 s4 tma"),
               (None, "64x128x128 w4 s3 tma pers2")),
}

# What the sweep times (each at every M, bits checked against REFERENCE): decode-sized narrow tiles, the
# 64 x 128 family, two-warpgroup tiles, persistent forms, and the 64 x 128 TMA tile with per-column scales
# (what one weight scale per tile saves).
BLOCK_SWEEP_CANDIDATES: tuple[str, ...] = (
    REFERENCE, "64x128x128 w4 s3 tma cols",
    "64x32x128 w4 s6 tma", "64x32x128 w4 s8 tma", "64x64x128 w4 s4 tma", "64x64x128 w4 s6 tma",
    "64x128x128 w4 s4 tma",
    "64x128x128 w4 s3 tma", "64x128x128 w4 s3 tma pers2", "64x256x128 w4 s3 tma",
    "128x128x128 w8 s3 tma", "128x128x128 w8 s4 tma", "128x128x128 w8 s3 tma pers1",
    "128x256x128 w8 s3 tma", "128x256x128 w8 s3 tma pers1",
)


# A JSON file {"class": [[max_m or null, "config name"], ...]} (bench_fp8.py --block-table-out writes the
# sweep's) that CUDA backends run instead of BLOCK_BUCKET_TABLE, read once per backend: a sweep's table
# measured end to end without a code change. The planner proves whichever table runs.
BLOCK_TABLE_ENV = "DEEPINFER_FP8_BLOCK_TABLE"


def load_block_table(path: str | None) -> Table:
    """BLOCK_BUCKET_TABLE with the classes of the JSON table at `path` replaced (None / "": unchanged);
    ValueError for a malformed table (bounds not ascending, the last not open-ended, a bad config name)."""
    if not path:
        return BLOCK_BUCKET_TABLE
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    table: dict[str, tuple[tuple[int | None, str], ...]] = {}
    for cls, buckets in raw.items():
        rows = tuple((None if b is None else int(b), str(name)) for b, name in buckets)
        bounds = [b for b, _ in rows]
        if cls not in BLOCK_BUCKET_TABLE or not rows or bounds[-1] is not None or None in bounds[:-1] \
                or bounds[:-1] != sorted(bounds[:-1]):
            raise ValueError(f"{path}: class {cls!r}: expected one of {sorted(BLOCK_BUCKET_TABLE)} with "
                             f"ascending bounds, the last null, got {bounds}")
        for _, name in rows:
            parse_config(name)
        table[cls] = rows
    return {**BLOCK_BUCKET_TABLE, **table}


def shape_class(n: int, k: int) -> str:
    """The bucket-table class of an [N, K] weight: "wide" (gate_up-like), "long_k" (down-like), else
    "default" (qkv / o)."""
    if n >= 8192:
        return "wide"
    if k >= 8192:
        return "long_k"
    return "default"


def block_buckets(n: int, k: int, table: Table | None = None
                  ) -> tuple[tuple[int | None, dict[str, int]], ...]:
    """(max_m, config) by ascending M for an [N, K] weight, from `table` (default BLOCK_BUCKET_TABLE; never
    from M)."""
    rows = (table or BLOCK_BUCKET_TABLE)[shape_class(n, k)]
    return tuple((max_m, parse_config(name)) for max_m, name in rows)


def block_tile_config(m: int | None, n: int, k: int, table: Table | None = None) -> dict[str, int]:
    """`REFERENCE` when `m` is None (invariant without a proven table), else the bucket for M (fast)."""
    if m is None:
        return parse_config(REFERENCE)
    return bucket_for(block_buckets(n, k, table), m)


def _pointer(cfg: dict[str, int]) -> dict[str, int]:
    return {key: v for key, v in cfg.items() if key not in ("TMA", "PERSISTENT", "COL_SCALES")}


class BlockPlanner(BucketPlanner[dict[str, int]]):
    """`block_buckets` where the device proves them bitwise equal to `REFERENCE`, else `REFERENCE` for every
    M; one per engine (owned by the CUDA invariant ops backend). The verdict is per weight shape and per
    `scale_block_n` (whether the per-tile weight scale runs)."""

    def __init__(self, table: Table | None = None) -> None:
        super().__init__(lambda n, k, d: block_buckets(n, k, table), lambda n, k, d: parse_config(REFERENCE),
                         block_matmul, prove_single=True)

    def config(self, xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype, scale_block_n: int) -> dict[str, int]:
        """The config for this call (the first call per weight shape runs the proof: probe rows times this
        call's weight)."""
        n, k = weight.shape
        return self.choose(xq.shape[0], n, k, out_dtype, xq.device, weight, weight_scale, bias, out_dtype,
                           scale_block_n, key_extra=scale_block_n)

    def _agree(self, *args: object) -> bool:
        weight, weight_scale, bias, out_dtype, scale_block_n, buckets = args
        pq, ps = quantize_act(probe_rows(weight.shape[1], weight.device, out_dtype, scale=4), 128)
        runs: list[tuple[dict[str, int], int]] = [(parse_config(REFERENCE), 0)]
        for _, cfg in buckets:
            for run in ((cfg, scale_block_n), (cfg, 0), (_pointer(cfg), 0)):
                if run not in runs:
                    runs.append(run)
        return outputs_agree(lambda run: block_matmul(pq, ps, weight, weight_scale, bias, out_dtype, run[0],
                                                      scale_block_n=run[1]), runs)


def _choose(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
            bias: torch.Tensor | None, out_dtype: torch.dtype, invariant: bool, planner: BlockPlanner | None,
            scale_block_n: int, table: Table | None) -> dict[str, int]:
    n, k = weight.shape
    if not invariant:
        return block_tile_config(xq.shape[0], n, k, table)
    if planner is not None:
        return planner.config(xq, xs, weight, weight_scale, bias, out_dtype, scale_block_n)
    return block_tile_config(None, n, k)


def block_linear_quantized(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor,
                           weight_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                           out_dtype: torch.dtype, group: int = 128, invariant: bool = True,
                           planner: BlockPlanner | None = None, scale_block_n: int = 0,
                           table: Table | None = None) -> torch.Tensor:
    """The block-scaled GEMM on rows the producing op quantized per token and K-group (xq e4m3 [M, K], xs
    float32 [M, K/group], `quantize_act`'s contract, e.g. from kernels/fp8_group_quant.py) -> [M, N] in
    `out_dtype`; bitwise `block_linear(x)` when (xq, xs) == quantize_act(x, group). `invariant`: tiles by
    proven M bucket (`planner`, with its own table) or REFERENCE; else the bucket of `table` (default
    BLOCK_BUCKET_TABLE) for M; `scale_block_n`: see kernels/fp8_block_tma.py (TILE_WS)."""
    check_tensor("xq", xq, ndim=2, dtypes=(FP8_DTYPE,))
    check_tensor("xs", xs, ndim=2, dtypes=(torch.float32,), device=xq.device)
    m, k = xq.shape
    _check_weight(weight, weight_scale, k, group, (), xq.device)
    if tuple(xs.shape) != (m, weight_scale.shape[1]):
        raise ValueError(f"xs: shape {tuple(xs.shape)}, expected ({m}, {weight_scale.shape[1]}) (one scale "
                         f"per token and K-group of {group})")
    if m == 0 or weight.shape[0] == 0:
        return torch.empty((m, weight.shape[0]), dtype=out_dtype, device=xq.device)
    if group == 128:
        cfg = _choose(xq, xs, weight, weight_scale, bias, out_dtype, invariant, planner, scale_block_n, table)
    else:   # the bucket table is for 128-wide K-groups: other groups keep the single config, BLOCK_K = group
        cfg = {**parse_config(REFERENCE), "BLOCK_K": group}
    return block_matmul(xq, xs, weight, weight_scale, bias, out_dtype, cfg, scale_block_n=scale_block_n)


def block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None = None, *, group: int = 128, invariant: bool = True,
                 planner: BlockPlanner | None = None, scale_block_n: int = 0,
                 table: Table | None = None) -> torch.Tensor:
    """x [M, K] quantized per token and K-group (`quantize_act`), then `block_linear_quantized`."""
    check_tensor("x", x, ndim=2)
    xq, xs = quantize_act(x, group)
    return block_linear_quantized(xq, xs, weight, weight_scale, bias, out_dtype=x.dtype, group=group,
                                  invariant=invariant, planner=planner, scale_block_n=scale_block_n,
                                  table=table)
