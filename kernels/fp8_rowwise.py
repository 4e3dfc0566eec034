"""Rowwise-scaled FP8 GEMM: out = (x_q @ w_q^T) * s_x[:, None] * s_w[None, :], scales applied once.

For per-channel and per-tensor FP8 weights ("FP8-Dynamic" checkpoints, `quantization="fp8-channel"`):
`quantize_rows` (kernels/fp8_row_quant.py) turns activations x [M, K] into e4m3 with ONE float32 scale per
row (max |x| of the row / 448), or the op producing x already did (kernels/fp8_fused_quant.py:
`fp8_rowwise_linear_quantized` takes those rows); the weight is e4m3 [N, K] with one scale per output
channel [N, 1] (a per-tensor scale broadcast).
Since no scale varies along K, the K loop is a plain `acc = tl.dot(a, b, acc)` chain (the tensor-core
pipeline runs asynchronously, like torch._scaled_mm rowwise) and both scales multiply the fp32 accumulator
once in the epilogue. The math is `fp8_linear_ref` with a single K-group (kernels/reference/fp8_matmul.py).

Accumulation precision: every table config has IMPRECISE_ACC = 0, Triton's default, which on sm_90 is
2^30, i.e. the tensor core's FP8 partial sums are never promoted to a full fp32 add (the fast accumulation
vLLM's per-channel FP8 kernels use too; torch._scaled_mm's default promotes). On random data the result is
within 2% of the float64 reference at K = 4,096 (4% at 14,336); on rows that correlate with a weight row
(all products of a sum of the same sign) it lands low: 6-7% at K = 4,096 and 18-19% at K = 14,336 when the
rows are the weight's own rows. IMPRECISE_ACC = 128 promotes after every K tile (DeepSeek-V3's choice for
its FP8 GEMMs): below 0.5% in every case, but 1.24-1.53x the time of the best default tile at M = 256 and
~1.4x in prefill on the 8B shapes, so it stays a candidate, not the default (benchmarks/RESULTS.md,
2026-12-02 02:20, 2026-12-03 19:40 and 21:58 UTC; benchmarks/fp8_rowwise_accuracy.py).

Batch invariance (`invariant=True`): the row scale is row-local (its max is exact whatever the chunking),
K is walked in increasing order with no split-K and rows past M read row 0 and are never stored, so a row's
bits depend on neither M nor the other rows as long as the tile config does not depend on M. Without a
planner the config is a function of (N, K) only. With a `RowwisePlanner` (one per engine, owned by the CUDA
invariant ops backend) it is chosen per M bucket (`rowwise_buckets`: small tiles for decode-sized M, wide
ones for prefill, all with BLOCK_K = 128 and the same IMPRECISE_ACC), but only for weight shapes where the
device proved every bucket's config, TMA and pointer loads alike, gives the same bits (the scheme of
kernels/bucket_planner.py, shared with the bf16 GEMM). The fast mode picks the tile from M freely.

Tile loads: "TMA": 1 in a config fetches the tiles by TMA descriptors (kernels/fp8_rowwise_tma.py) where
the device and the operands allow (Hopper+, 16-byte aligned rows), else by pointer loads; the same bits.
`ROWWISE_CANDIDATES` / `ROWWISE_TMA_CANDIDATES` are the tiles a sweep (benchmarks/bench_fp8.py --sweep)
compares on the device; `config=` runs any of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels._checks import check_tensor, stages_that_fit
from deepinfer.kernels.bucket_planner import BucketPlanner, bucket_for, outputs_agree, probe_rows
from deepinfer.kernels.fp8_matmul import grouped_tile
from deepinfer.kernels.fp8_row_quant import quantize_rows
from deepinfer.kernels.fp8_rowwise_tma import rowwise_tma_launch
from deepinfer.kernels.gemm_parts import rowwise_epilogue
from deepinfer.kernels.matmul_tma import tma_usable
from deepinfer.kernels.reference.fp8_matmul import FP8_DTYPE

__all__ = ["quantize_rows", "fp8_rowwise_linear", "fp8_rowwise_linear_quantized", "rowwise_tile_config",
           "fp8_rowwise_swiglu_quantized",
           "rowwise_buckets", "RowwisePlanner", "ROWWISE_CANDIDATES", "ROWWISE_TMA_CANDIDATES"]


def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int, imprecise: int = 0, tma: int = 0,
         persistent: int = 0, flatten: int = 0) -> dict[str, int]:
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps,
           "num_stages": stages, "IMPRECISE_ACC": imprecise}
    if tma:   # TMA-only keys: absent from pointer configs, so those keep their names and cache keys
        cfg["TMA"] = 1
        if persistent:
            cfg["PERSISTENT"] = 1
            if flatten:
                cfg["FLATTEN"] = 1
    return cfg


def _tma(cfg: dict[str, int], persistent: int = 0) -> dict[str, int]:
    """`cfg` with TMA tile loads (and optionally the persistent tile loop)."""
    return {**cfg, "TMA": 1, **({"PERSISTENT": 1} if persistent else {})}


def fit_to_device(cfg: dict[str, int], device: torch.device) -> dict[str, int]:
    """`cfg` itself, or a copy with the pipeline depth `device`'s shared memory holds
    (`stages_that_fit`; the same bits): what a launch of `cfg` runs there."""
    stages = stages_that_fit(cfg["num_stages"], (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"], device)
    return cfg if stages == cfg["num_stages"] else {**cfg, "num_stages": stages}


def _pointer(cfg: dict[str, int]) -> dict[str, int]:
    """`cfg` with pointer tile loads (the same tile, one program per tile)."""
    return {key: v for key, v in cfg.items() if key not in ("TMA", "PERSISTENT", "FLATTEN")}


# Hopper candidates (smem per stage = (BLOCK_M + BLOCK_N) * BLOCK_K bytes; 228 KiB per SM on the H200).
# IMPRECISE_ACC > 0 passes `max_num_imprecise_acc` to tl.dot: the fp8 tensor-core partial sums are promoted
# to a full fp32 add every that many K elements (0 = Triton's default for the device).
ROWWISE_CANDIDATES: tuple[dict[str, int], ...] = (
    _cfg(128, 256, 128, 8, 3), _cfg(128, 256, 128, 8, 4), _cfg(128, 128, 128, 4, 4),
    _cfg(128, 128, 128, 8, 4), _cfg(128, 128, 128, 8, 5), _cfg(64, 128, 128, 4, 4),
    _cfg(64, 128, 128, 4, 6), _cfg(64, 256, 128, 4, 4), _cfg(64, 64, 128, 4, 6),
    _cfg(128, 128, 64, 4, 6), _cfg(256, 128, 128, 8, 3), _cfg(128, 256, 128, 8, 3, imprecise=128),
    _cfg(64, 128, 128, 4, 4, imprecise=128),
)
# The same tiles through TMA, plus the persistent tile loop for the prefill-sized ones and narrower decode
# tiles (only TMA ones: small tiles are where pointer loads cost the most registers).
ROWWISE_TMA_CANDIDATES: tuple[dict[str, int], ...] = (
    *(_tma(c) for c in ROWWISE_CANDIDATES),
    _cfg(128, 256, 128, 8, 3, tma=1, persistent=1), _cfg(128, 256, 128, 8, 4, tma=1, persistent=1),
    _cfg(128, 128, 128, 8, 4, tma=1, persistent=1), _cfg(64, 64, 128, 4, 4, tma=1),
    _cfg(64, 32, 128, 4, 6, tma=1), _cfg(64, 128, 128, 4, 5, tma=1),
    # Deeper pipelines for decode-sized M (a long K on few tiles waits on its loads) and the flattened
    # persistent loop for prefill-sized M (added for the sweep of 2026-12-03, 17:39).
    _cfg(64, 32, 128, 4, 8, tma=1), _cfg(64, 64, 128, 4, 8, tma=1), _cfg(64, 128, 128, 4, 7, tma=1),
    _cfg(64, 128, 128, 4, 8, tma=1), _cfg(64, 256, 128, 4, 5, tma=1), _cfg(128, 128, 128, 4, 6, tma=1),
    _cfg(128, 128, 128, 8, 6, tma=1), _cfg(256, 128, 128, 8, 4, tma=1, persistent=1),
    _cfg(128, 256, 128, 8, 3, tma=1, persistent=1, flatten=1),
    _cfg(128, 256, 128, 8, 4, tma=1, persistent=1, flatten=1),
    _cfg(128, 128, 128, 8, 5, tma=1, persistent=1, flatten=1),
)


def rowwise_tile_config(m: int | None, n: int, k: int) -> dict[str, int]:
    """Tile config: from (N, K) only when `m` is None (invariant without a planner, and the planner's single
    config where buckets are not proven), else also from M (fast).

    The single invariant config is 64 x 128 for every M, so decode batches keep enough tiles to fill the
    GPU; the fast mode takes `rowwise_buckets`' tile for its M (the fastest measured per M). Loads by TMA
    where possible (same bits). benchmarks/bench_fp8.py --sweep prints the best per shape.
    """
    if m is None:
        return _cfg(64, 128, 128, 4, 4, tma=1)
    return bucket_for(rowwise_buckets(n, k), m)


def rowwise_buckets(n: int, k: int) -> tuple[tuple[int | None, dict[str, int]], ...]:
    """(max_m, config) by ascending M bucket, the last open-ended, for the invariant mode's planner and the
    fast mode. Every bucket keeps BLOCK_K = 128 and IMPRECISE_ACC = 0, so an element is the same fp32 dot
    chain in each; a function of the weight shape only, never of M.

    Measured on the H200 (2026-12-03 17:39–17:48 UTC, `bench_fp8.py --skip-gemm --skip-e2e --sweep
    --sweep-kernels rowwise --sweep-loads tma --sweep-names ...`, weights read from HBM, µs per call;
    benchmarks/RESULTS.md has the table and the end-to-end effect). Decode-sized M: deep
    pipelines (8 stages) on 64-row tiles where the tiles fit in one wave of the 132 SMs, since a K loop on
    few tiles waits on its loads; at M = 64 / 128 / 256, the 02:20 table -> this one: down 36.1 / 37.1 /
    39.7 -> 22.6 / 24.4 / 26.9, o 12.8 / 13.4 / 13.7 -> 9.2 / 10.0 / 10.7, qkv 13.8 / 14.3 / 15.2 -> 10.8 /
    11.2 / 15.2 (its 192 tiles of 64 x 128 at M = 256 take two waves at 8 stages, 19.0: it keeps 4 stages
    there). gate_up keeps its tiles (64 x 128 up to 64 rows, then persistent 128 x 256). Larger M:
    persistent 128 x 256 tiles with the tile loop flattened into the K loop (FLATTEN), at M = 8,192 /
    16,384: down 713 / 1,429 -> 667 / 1,427, o 205 / 447 -> 195 / 402, qkv 351 / 685 -> 320 / 657,
    gate_up 1,605 / 3,148 -> 1,553 / 3,067; gate_up's middle bucket flattened too (M = 1,024 / 2,048 /
    4,096: 174.5 / 385.2 / 787.5 -> 170.7 / 369.2 / 770.3). Every one of the 26 configs swept gave the same
    bits on every 8B shape at every M.
    """
    prefill = _cfg(128, 256, 128, 8, 3, tma=1, persistent=1, flatten=1)
    if n >= 8192:            # gate_up-like: wide output
        return ((64, _cfg(64, 128, 128, 4, 4, tma=1)),
                (4096, _cfg(128, 256, 128, 8, 4, tma=1, persistent=1, flatten=1)), (None, prefill))
    if k >= 8192:            # down-like: long K
        return ((64, _cfg(64, 32, 128, 4, 8, tma=1)), (128, _cfg(64, 64, 128, 4, 8, tma=1)),
                (256, _cfg(64, 128, 128, 4, 8, tma=1)), (None, prefill))
    if n <= 4096:            # o-like: one wave of 64 x 64 / 64 x 128 tiles up to 128 / 256 rows
        return ((64, _cfg(64, 32, 128, 4, 8, tma=1)), (128, _cfg(64, 64, 128, 4, 8, tma=1)),
                (256, _cfg(64, 128, 128, 4, 8, tma=1)), (None, prefill))
    return ((64, _cfg(64, 32, 128, 4, 8, tma=1)), (128, _cfg(64, 128, 128, 4, 8, tma=1)),
            (256, _cfg(64, 128, 128, 4, 4, tma=1)), (None, prefill))


def _probe_rows(k: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The proof's fixed random rows (bucket_planner.probe_rows, times 4), quantized per row."""
    return quantize_rows(probe_rows(k, device, dtype, scale=4))


class RowwisePlanner(BucketPlanner[dict[str, int]]):
    """`rowwise_buckets` where the device proves them bitwise equal, else `rowwise_tile_config(None, ..)`
    for every M; one per engine (kernels/bucket_planner.py has the scheme). The proof multiplies fixed
    random rows (`_probe_rows`) with the call's weight, scales and bias, and also runs every bucket config
    with pointer loads, so a call whose operands TMA cannot read (and that falls back to pointer loads)
    keeps the bits of the others."""

    def __init__(self) -> None:
        super().__init__(lambda n, k, d: rowwise_buckets(n, k),
                         lambda n, k, d: rowwise_tile_config(None, n, k), rowwise_matmul)

    def config(self, xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype) -> dict[str, int]:
        """The config for this call (the first call per weight shape runs the proof: probe rows times this
        call's weight)."""
        n, k = weight.shape
        return self.choose(xq.shape[0], n, k, out_dtype, xq.device, xq, xs, weight, weight_scale, bias,
                           out_dtype)

    def _agree(self, *args: object) -> bool:
        _, _, weight, weight_scale, bias, out_dtype, buckets = args
        pq, ps = _probe_rows(weight.shape[1], weight.device, out_dtype)
        configs: list[dict[str, int]] = []
        for _, cfg in buckets:
            for variant in (cfg, _pointer(cfg)):
                if variant not in configs:
                    configs.append(variant)
        return outputs_agree(lambda cfg: rowwise_matmul(pq, ps, weight, weight_scale, bias, out_dtype, cfg),
                             configs)


@triton.jit(do_not_specialize=["M"])
def _rowwise_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, out_ptr, M, N, K,
                         stride_am, stride_bn, stride_bsn, stride_om,
                         HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, SWIGLU: tl.constexpr = 0):
    offs_m, offs_n, rows, cols = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + cols[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - ki * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if IMPRECISE_ACC > 0:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=IMPRECISE_ACC)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    rowwise_epilogue(acc, as_ptr, bs_ptr, bias_ptr, out_ptr, offs_m, offs_n, rows, cols, M, N, stride_bsn,
                     stride_om, HAS_BIAS, SWIGLU, BLOCK_N)


def _check_rowwise_weight(weight: torch.Tensor, scale: torch.Tensor, k: int, device: torch.device) -> None:
    check_tensor("weight", weight, ndim=2, dtypes=(FP8_DTYPE,), device=device)
    check_tensor("weight_scale", scale, ndim=2, dtypes=(torch.float32,), device=device)
    if weight.shape[1] != k:
        raise ValueError(f"weight: shape {tuple(weight.shape)} does not match K={k}")
    if tuple(scale.shape) != (weight.shape[0], 1):
        raise ValueError(f"weight_scale: shape {tuple(scale.shape)}, expected ({weight.shape[0]}, 1) (one "
                         "scale per output channel; broadcast a per-tensor scale)")


def _check_quantized_rows(xq: torch.Tensor, xs: torch.Tensor) -> None:
    check_tensor("xq", xq, ndim=2, dtypes=(FP8_DTYPE,))
    check_tensor("xs", xs, ndim=2, dtypes=(torch.float32,), device=xq.device, last_dim_contiguous=False)
    m = xq.shape[0]
    if tuple(xs.shape) != (m, 1) or (m > 1 and xs.stride(0) != 1):
        raise ValueError(f"xs: shape {tuple(xs.shape)} strides {tuple(xs.stride())}, expected ({m}, 1) "
                         "contiguous (one scale per row)")


def rowwise_matmul(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None, out_dtype: torch.dtype, config: dict[str, int],
                   swiglu: bool = False) -> torch.Tensor:
    """The GEMM alone on pre-quantized rows (xq e4m3 [M, K], xs [M, 1]); benchmarks time it separately.
    `swiglu`: `weight` is a gate_up weight with rows alternating gate j, up j (no bias) and the result is
    silu(gate) * up [M, N / 2], computed in the epilogue (`fp8_rowwise_swiglu_quantized`)."""
    m, k = xq.shape
    n = weight.shape[0]
    out = torch.empty((m, n // 2 if swiglu else n), dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    cfg = fit_to_device(config, xq.device)
    if cfg.get("TMA", 0) and tma_usable(xq, weight):
        return rowwise_tma_launch(xq, xs, weight, weight_scale, bias, out, cfg, swiglu)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _rowwise_gemm_kernel[grid](
        xq, xs, weight, weight_scale, bias if bias is not None else out, out, m, n, k,
        xq.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % cfg["BLOCK_K"] == 0, IMPRECISE_ACC=cfg.get("IMPRECISE_ACC", 0),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        SWIGLU=int(swiglu), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def _choose(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
            bias: torch.Tensor | None, out_dtype: torch.dtype, invariant: bool,
            config: dict[str, int] | None, planner: RowwisePlanner | None) -> dict[str, int]:
    if config is not None:
        return config
    n, k = weight.shape
    if not invariant:
        return rowwise_tile_config(xq.shape[0], n, k)
    if planner is not None:
        return planner.config(xq, xs, weight, weight_scale, bias, out_dtype)
    return rowwise_tile_config(None, n, k)


def fp8_rowwise_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None = None, *, invariant: bool = True,
                       config: dict[str, int] | None = None,
                       planner: RowwisePlanner | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(weight [N, K] e4m3, weight_scale [N, 1])^T (+ bias [N]) -> [M, N] in x's dtype,
    x quantized per row on the fly. `invariant`: a batch-invariant tile config (by M bucket where `planner`
    proved it safe, else one for every M); `config` overrides it."""
    check_tensor("x", x, ndim=2)
    m, k = x.shape
    _check_rowwise_weight(weight, weight_scale, k, x.device)
    if m == 0 or weight.shape[0] == 0:
        return torch.empty((m, weight.shape[0]), dtype=x.dtype, device=x.device)
    xq, xs = quantize_rows(x)
    cfg = _choose(xq, xs, weight, weight_scale, bias, x.dtype, invariant, config, planner)
    return rowwise_matmul(xq, xs, weight, weight_scale, bias, x.dtype, cfg)


def fp8_rowwise_linear_quantized(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor,
                                 weight_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                                 out_dtype: torch.dtype, invariant: bool = True,
                                 config: dict[str, int] | None = None,
                                 planner: RowwisePlanner | None = None) -> torch.Tensor:
    """`fp8_rowwise_linear` on rows the producing op already quantized: xq e4m3 [M, K] with float32 row
    scales xs [M, 1] (`quantize_rows`' contract, e.g. from kernels/fp8_fused_quant.py) -> [M, N] in
    `out_dtype`; bitwise `fp8_rowwise_linear(x)` when (xq, xs) == quantize_rows(x)."""
    m, k = xq.shape
    _check_quantized_rows(xq, xs)
    _check_rowwise_weight(weight, weight_scale, k, xq.device)
    if m == 0 or weight.shape[0] == 0:
        return torch.empty((m, weight.shape[0]), dtype=out_dtype, device=xq.device)
    cfg = _choose(xq, xs, weight, weight_scale, bias, out_dtype, invariant, config, planner)
    return rowwise_matmul(xq, xs, weight, weight_scale, bias, out_dtype, cfg)


def fp8_rowwise_swiglu_quantized(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor,
                                 weight_scale: torch.Tensor, *, out_dtype: torch.dtype,
                                 invariant: bool = True, config: dict[str, int] | None = None,
                                 planner: RowwisePlanner | None = None) -> torch.Tensor:
    """silu(gate) * up [M, I] of an MLP's gate_up projection, the SwiGLU in the GEMM's epilogue: `weight`
    [2I, K] e4m3 and `weight_scale` [2I, 1] with rows alternating gate j, up j (engine/models/quant/
    fp8_tensor.interleave_gate_up), rows quantized as in `fp8_rowwise_linear_quantized`. Bitwise
    kernels/activation.silu_and_mul of that function's output on the [gate | up] weight: the tile config
    is chosen the same way (by M bucket where `planner` proved it on this weight shape), every GEMM element
    is rounded as that one stores it, and the activation is the same function."""
    m, k = xq.shape
    _check_quantized_rows(xq, xs)
    _check_rowwise_weight(weight, weight_scale, k, xq.device)
    if weight.shape[0] % 2:
        raise ValueError(f"weight: {weight.shape[0]} rows, expected an even count (gate and up)")
    if m == 0 or weight.shape[0] == 0:
        return torch.empty((m, weight.shape[0] // 2), dtype=out_dtype, device=xq.device)
    cfg = _choose(xq, xs, weight, weight_scale, None, out_dtype, invariant, config, planner)
    return rowwise_matmul(xq, xs, weight, weight_scale, None, out_dtype, cfg, swiglu=True)
