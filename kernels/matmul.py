"""Batch-invariant GEMM for linear layers: out = x @ weight.T (+ bias).

Batch invariance: every output element is accumulated in fp32 over K in tiles of BLOCK_K, in increasing
order, by one `tl.dot` chain whose shape (BLOCK_M x BLOCK_N x BLOCK_K) and compile options are chosen from
(N, K, dtype) only — never from M. There is no M-dependent split-K (a config may ask for a fixed-order one,
`MatmulConfig.split_k`: a fixed number of K ranges, each one such chain, summed in range order), and rows
beyond M are clamped to row 0 (their results are never stored), so a row's bits do not depend on how many
other rows share the call or on which tile or program computes it. `M` is excluded from Triton's integer
specialisation so one compiled binary serves every M. The persistent tile loop only changes which program
runs a tile, never how a tile is computed.

Decode-sized M: one tile shape cannot serve both a 256-row decode step and an 8k-token prefill well (at
M = 256 a 128-row tile leaves half the SMs idle on the 4096-wide layers). `MatmulPlanner` therefore picks a
config per M bucket, all with the same BLOCK_K, so every element is still one fp32 chain of the same
BLOCK_K-wide dots in the same K order; only which program and which MMA tile shape computes it differ.
That this gives identical bits is a property of the GPU's MMA units, not a language guarantee, so the
planner proves it per weight shape on the device before using it: the first call for a shape runs every
bucket's config on that call's input and compares the results bitwise; if any differs, that shape keeps a
single config for every M (invariance first, speed second). On the H200 all 58 configs tried with
BLOCK_K = 64 (two sweeps, 58 and 43 configs) agreed bitwise on every Llama-3.1-8B layer shape, and every
single-chain config of benchmarks/gemm_sweep.py (15 narrow, 9 wide) on the Qwen2.5-0.5B shapes
(benchmarks/RESULTS.md); those shapes take configs of their own (`_TUNED`).

Tile loads: the tuned configs fetch their tiles with TMA (kernels/matmul_tma.py) where the operands allow; the
dot chain, and so the bits, are the pointer kernel's (every config of the 8B sweep agreed bitwise both ways),
and the planner's proof covers a bucket that falls back to pointer loads like any other config.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from deepinfer.kernels._checks import check_same_dtype, check_tensor, num_sms, stages_that_fit
from deepinfer.kernels.bucket_planner import BucketPlanner, outputs_agree, probe_rows
from deepinfer.kernels.gemm_parts import grouped_tile_ids, k_chain, linear_epilogue, split_ranges
from deepinfer.kernels.matmul_split import SplitSum, split_launch, split_partials
from deepinfer.kernels.matmul_tma import tma_launch, tma_usable


@dataclass(frozen=True)
class MatmulConfig:
    """Tile shape and compile options of one GEMM. Changing it may change result bits (not invariance)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    persistent: bool = True     # grid of min(#SMs, #tiles) programs looping over tiles; else one per tile
    # K split into this many contiguous ranges of k-tiles, each an fp32 chain from zero, summed in range
    # order (kernels/matmul_split.py): a fixed order (never M-dependent), but other bits than split_k=1, so
    # every M bucket of a weight must use the same split_k (like BLOCK_K). Parallel form: a program per
    # (tile, range), fp32 partials, a second kernel sums them (`persistent` is ignored).
    split_k: int = 1
    # With split_k > 1: the serial form instead, the ranges one after another in the tile's program and
    # their sum kept in registers (no partials in memory; the same bits as the parallel form).
    serial_split: bool = False
    # Tiles fetched by TMA descriptors (kernels/matmul_tma.py) where the device and strides allow, else by
    # pointer loads: the same dot chain, so the same bits (proven per shape like a tile change).
    tma: bool = False
    # Persistent, without a split: the TMA kernel's tile loop software-pipelined together with its K loop,
    # so the next tile's loads are in flight during this tile's epilogue (the pointer kernel ignores it).
    # A schedule change only: the same chains, the same bits.
    flatten: bool = False

    def __post_init__(self) -> None:
        for field in ("block_m", "block_n", "block_k"):
            value = getattr(self, field)
            if value < 16 or value & (value - 1):
                raise ValueError(f"MatmulConfig.{field}={value}: must be a power of two >= 16")
        if self.group_m < 1:
            raise ValueError(f"MatmulConfig.group_m={self.group_m}: must be >= 1")
        if not 1 <= self.split_k <= 64:
            raise ValueError(f"MatmulConfig.split_k={self.split_k}: must be in 1..64")
        if self.serial_split and self.split_k == 1:
            raise ValueError("MatmulConfig.serial_split=True needs split_k > 1 (nothing to serialize)")
        if self.flatten and not (self.persistent and self.split_k == 1):
            raise ValueError("MatmulConfig.flatten=True needs persistent=True and split_k=1 (one tile loop "
                             "around one K loop)")

    def fit_to_device(self, element_size: int, device: torch.device) -> MatmulConfig:
        """This config, or a copy with the pipeline depth `device`'s shared memory holds for operands of
        `element_size` bytes (`stages_that_fit`; the same bits): what a launch of it runs there."""
        stage_bytes = (self.block_m + self.block_n) * self.block_k * element_size
        stages = stages_that_fit(self.num_stages, stage_bytes, device)
        return self if stages == self.num_stages else replace(self, num_stages=stages)


# float32 weights at most this wide with K at least this long take a fixed split-K (matmul_config).
_NARROW_F32_N = 256
_NARROW_F32_MIN_K = 1024


def matmul_config(n: int, k: int, dtype: torch.dtype) -> MatmulConfig:
    """The tile config for a weight of shape [n, k]. Depends on the weight only, never on M.

    Wide weights (gate_up, lm_head) take 128x256 tiles (highest tensor-core efficiency); narrower ones take
    128x128 so a decode step (M <= 128) still spreads over more SMs.
    """
    if dtype == torch.float32:
        if n <= _NARROW_F32_N and k >= _NARROW_F32_MIN_K:
            # A MoE router (float32, 64-256 experts, K = hidden): a decode step has one or two row tiles
            # and one column tile, so without a split one or two programs walked all of K (177 us per call
            # on average in a V2-Lite profile, benchmarks/RESULTS.md 2026-12-02 14:45). A fixed split from K
            # alone keeps the order M-independent.
            return MatmulConfig(block_m=32, block_n=64, block_k=32, num_warps=4, num_stages=3,
                                split_k=min(16, max(1, triton.cdiv(k, 32) // 4)))
        return MatmulConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3)
    if (n, k) in _TUNED:   # a tuned weight shape (below): its open-ended bucket's config
        return _TUNED[(n, k)][-1][1]
    if n >= 8192:
        return _cfg(128, 256, 8, 3, persistent=True)
    return _cfg(128, 128, 8, 4, persistent=True)


def _cfg(bm: int, bn: int, warps: int, stages: int, persistent: bool = False, split: int = 1,
         serial: bool = False) -> MatmulConfig:
    # Every tuned config loads its tiles by TMA where the operands allow (Hopper+): same bits, and faster
    # on every 8B layer shape at M = 128, 256 and 8192 in the 02:00 UTC sweep of 2026-12-02. Persistent
    # ones without a split flatten their tile loop into the K loop (benchmarks/gemm_flatten.py, 2026-12-04:
    # a 16,384-token prefill step's layer GEMMs 20.3 -> 18.0 ms on the 0.5B shape, 344 -> 336 on the 8B).
    return MatmulConfig(block_m=bm, block_n=bn, block_k=64, num_warps=warps, num_stages=stages,
                        persistent=persistent, tma=True, split_k=split, serial_split=serial,
                        flatten=persistent and split == 1)


# Buckets tuned for exact weight shapes (N, K) whose best tiles differ from the shape-class rule in
# _bucket_configs: the whole (max_m, config) list, ascending, the last open-ended, all BLOCK_K = 64 and one
# split_k. Keyed by the weight only, never by M; MatmulPlanner still proves every bucket bitwise equal on
# the device before using them, and matmul_config (its fallback) is the open-ended one. Measured with
# benchmarks/gemm_sweep.py (H200, Qwen2.5-0.5B shapes).
# us per call at M = 64 / 128 / 256, today's class rule -> the table (cuBLAS), 23:35 UTC sweep:
# qkv 5.3/5.6/6.8 -> 4.8/4.8/5.6 (4.6/4.6/5.0); o 5.2/5.2/6.4 -> 4.5/4.5/4.6 (4.3/4.4/4.7);
# gate_up 10.7/14.8/14.9 -> 8.6/9.9/14.9 (7.7/8.0/10.8); down 17.5/17.6/22.1 -> 14.0/14.0/14.2
# (8.4/8.8/10.2); lm_head 82/95/138 -> 79/96/134 (78/83/109). Many small column tiles with deep pipelines
# fill the SMs at K = 896 and at the long-K down projection; prefill keeps the class's 128x256 tiles.
_TUNED: dict[tuple[int, int], tuple[tuple[int | None, MatmulConfig], ...]] = {
    (1152, 896): ((128, _cfg(64, 32, 4, 6)), (256, _cfg(64, 64, 4, 6)), (None, _cfg(128, 256, 8, 3, True))),
    (896, 896): ((256, _cfg(64, 32, 4, 6)), (None, _cfg(128, 256, 8, 3, True))),
    (9728, 896): ((64, _cfg(64, 128, 4, 4)), (128, _cfg(128, 128, 8, 4, True)),
                  (None, _cfg(128, 256, 8, 4, True))),
    # The down projection's K = 4,864 over N = 896: a decode step has too few output tiles to fill the SMs,
    # so K is split in 4 fixed ranges at every M (kernels/matmul_split.py): the parallel form up to 256 rows,
    # the serial one beyond (the same bits). benchmarks/split_k_sweep.py, 2026-12-03 15:50 UTC, us per call
    # at M = 64 / 256 / 16,384: 14.8 / 15.2 / 211.1 unsplit -> 8.3 / 9.8 / 233.0 (cuBLAS 8.5 / 10.2 / 196.8):
    # -0.13 ms per 256-row decode step, +0.53 ms per 16k-token prefill step.
    (896, 4864): ((64, _cfg(64, 32, 4, 6, split=4)), (256, _cfg(64, 64, 4, 6, split=4)),
                  (None, _cfg(128, 128, 8, 4, True, split=4, serial=True))),
    (151936, 896): ((64, _cfg(64, 128, 4, 4)), (None, _cfg(128, 256, 8, 4, True))),
    # Llama-3.1-8B's narrow layers (and every model sharing their shapes): 8-stage pipelines keep more of
    # HBM's bandwidth in flight for a decode step's few row tiles (192 KB of tiles: MatmulConfig.
    # fit_to_device trims the stages on GPUs with less shared memory, same bits). `gemm_sweep.py --model
    # llama-3.1-8b`, 2026-12-03 17:57 UTC, us at M = 64 / 128 / 256, class rule -> table (cuBLAS): down
    # 49.5 / 50.6 / 60.7 -> 42.8 / 44.4 / 49.8 (36.9 / 38.7 / 49.5); o 16.4 / 16.8 / 18.9 -> 14.5 / 15.2 /
    # 16.3 (12.0 / 14.4 / 16.8); qkv 19.6 / 20.7 -> 18.1 / 18.9 (17.1 / 17.4); at 256 rows (2026-12-03
    # 19:42 UTC) 27.6 -> 24.7 (22.5) on 128x128 tiles at 6 stages: 96 tiles, one wave.
    (4096, 14336): ((64, _cfg(64, 32, 4, 8)), (128, _cfg(64, 64, 4, 8)), (256, _cfg(64, 128, 4, 8)),
                    (None, _cfg(128, 256, 8, 3, True))),
    (4096, 4096): ((64, _cfg(64, 32, 4, 8)), (128, _cfg(64, 64, 4, 8)), (256, _cfg(64, 128, 4, 8)),
                   (None, _cfg(128, 256, 8, 3, True))),
    (6144, 4096): ((64, _cfg(64, 64, 4, 8)), (128, _cfg(64, 128, 4, 8)), (256, _cfg(128, 128, 8, 6)),
                   (None, _cfg(128, 256, 8, 3, True))),
}


def _bucket_configs(n: int, k: int, dtype: torch.dtype) -> tuple[tuple[int | None, MatmulConfig], ...]:
    """(max_m, config) by ascending M bucket, the last open-ended. Every bucket keeps BLOCK_K = 64 (see the
    module docstring for why that matters).

    Measured on the H200 (kernel time in CUDA graphs, Llama-3.1-8B layer shapes, TMA tile loads,
    `benchmarks/gemm_sweep.py --model llama-3.1-8b --prefill-m 8192`, benchmarks/RESULTS.md): up to 128
    rows, 64x64 tiles with 6 stages (a decode step's few row tiles times many column tiles fill the SMs); up
    to 256 rows the same for weights up to 4096 wide (256 tiles: one wave of two per SM) and 64x128 with 4
    stages beyond (6144 wide: 384 tiles of 64x64 would be 1.5 waves); wide weights (gate_up, lm_head) take
    64x256 / 128x256 tiles; prefill-sized M takes persistent 128x256, 3 stages (4 for wide weights).
    """
    if dtype == torch.float32:
        return ((None, matmul_config(n, k, dtype)),)
    if (n, k) in _TUNED:
        return _TUNED[(n, k)]
    if n >= 8192:
        return ((64, _cfg(64, 256, 4, 4)), (256, _cfg(128, 256, 8, 4)), (None, _cfg(128, 256, 8, 4, True)))
    small = _cfg(64, 64, 4, 6)
    mid = small if n <= 4096 else _cfg(64, 128, 4, 4)
    return ((128, small), (256, mid), (None, _cfg(128, 256, 8, 3, True)))


class MatmulPlanner(BucketPlanner[MatmulConfig]):
    """Chooses `bi_linear`'s config by M bucket for weight shapes whose bucket configs agree bitwise.

    One planner per engine (the ops backend owns it). The verdict for a (N, K, dtype, device) is taken once,
    on the first call outside CUDA-graph capture, and never changes: a shape whose first call happens under
    capture, or whose configs disagree, uses `matmul_config` for every M (kernels/bucket_planner.py).
    """

    def __init__(self, flatten: bool = True) -> None:
        # The module's tables are looked up per call (not bound here), as before the shared planner.
        super().__init__(lambda n, k, d: _bucket_configs(n, k, d), lambda n, k, d: matmul_config(n, k, d),
                         lambda x, w, b, cfg: bi_linear(x, w, b, config=cfg))
        # False: the tables' flattened tile loops run unflattened (A/B runs; the same bits).
        self.flatten = flatten

    def config(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> MatmulConfig:
        n, k = weight.shape
        cfg = self.choose(x.shape[0], n, k, x.dtype, x.device, x, weight, bias)
        return cfg if self.flatten or not cfg.flatten else replace(cfg, flatten=False)

    @staticmethod
    def _agree(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               buckets: tuple[tuple[int | None, MatmulConfig], ...]) -> bool:
        # Fixed random rows, not the call's own: an engine's first call per shape can be the CUDA-graph
        # warm-up on zeroed buffers (an o-proj input of zeros agrees under any config, proving nothing).
        # Each config also runs with pointer loads: a call TMA cannot read must keep the others' bits.
        probe = probe_rows(weight.shape[1], x.device, x.dtype)
        configs: list[MatmulConfig] = []
        for _, cfg in buckets:
            for variant in (cfg, replace(cfg, tma=False)):
                if variant not in configs:
                    configs.append(variant)
        return outputs_agree(lambda cfg: bi_linear(probe, weight, bias, config=cfg), configs)



# Programs of the persistent loop when running on CPU (Triton interpreter): small, so tests exercise a
# program looping over several tiles.
_INTERPRETER_PROGRAMS = 4


@triton.jit
def _grouped_offsets(tile, num_pid_m, tiles_per_group, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     GROUP_M: tl.constexpr):
    """Row and column offsets of output tile `tile` in grouped order (gemm_parts.grouped_tile_ids)."""
    pid_m, pid_n = grouped_tile_ids(tile, num_pid_m, tiles_per_group, GROUP_M)
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit(do_not_specialize=["M"])
def _bi_linear_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SWIGLU: tl.constexpr = 0, SPLITS: tl.constexpr = 1, K_PER_SPLIT: tl.constexpr = 0,
):
    # SPLITS > 1: the serial form of a fixed-order split-K (kernels/matmul_split.py): ranges of K_PER_SPLIT
    # k-tiles, each a chain from zero, summed in range order as they finish.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_group = GROUP_M * num_pid_n
    offs_k = tl.arange(0, BLOCK_K)
    for tile in range(pid, num_tiles, num_programs):
        offs_m, offs_n = _grouped_offsets(tile, num_pid_m, tiles_per_group, BLOCK_M, BLOCK_N, GROUP_M)
        # Out-of-range rows/columns read row/column 0 instead of being masked: the inner loop stays
        # mask-free and those results are never stored. A row only ever meets its own data in the dot.
        rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
        cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
        x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
        w_ptrs = w_ptr + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SPLITS == 1:
            acc = k_chain(zero, x_ptrs, w_ptrs, offs_k, K, 0, k_tiles, stride_xk, stride_wk, EVEN_K, IEEE,
                          BLOCK_K)
        else:
            acc = k_chain(zero, x_ptrs, w_ptrs, offs_k, K, 0, tl.minimum(K_PER_SPLIT, k_tiles), stride_xk,
                          stride_wk, EVEN_K, IEEE, BLOCK_K)
            for s in tl.static_range(1, SPLITS):
                k_first = s * K_PER_SPLIT
                step = k_first * BLOCK_K
                acc += k_chain(zero, x_ptrs + step * stride_xk, w_ptrs + step * stride_wk, offs_k, K, k_first,
                               tl.minimum(k_first + K_PER_SPLIT, k_tiles), stride_xk, stride_wk, EVEN_K, IEEE,
                               BLOCK_K)
        linear_epilogue(acc, b_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, stride_on, HAS_BIAS, SWIGLU,
                        BLOCK_N)


def bi_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: MatmulConfig | None = None,
    planner: MatmulPlanner | None = None,
    swiglu: bool = False,
    defer_sum: bool = False,
) -> torch.Tensor | SplitSum:
    """x [M, K] @ weight[N, K].T (+ bias [N]) -> [M, N] in x's dtype, fp32 accumulation, batch-invariant.

    `config` overrides the tile config (benchmarks); else `planner` picks it by M bucket where that is
    proven bitwise safe (MatmulPlanner); else it is `matmul_config(N, K, dtype)` for every M.
    `swiglu`: `weight` is a gate_up weight with rows alternating gate j, up j (models/quant/fp8_tensor.
    interleave_halves) and the result is silu(gate) * up [M, N / 2], computed in the GEMM's epilogue: bitwise
    kernels/activation.silu_and_mul of this function's output on the [gate | up] weight (same config, the
    same rounded elements, the same activation).
    `defer_sum`: where the config is a parallel split-K, return its partials unsummed (a `SplitSum`, for a
    consumer that sums them in the same order: kernels/rmsnorm.py); a tensor otherwise.
    """
    check_tensor("x", x, ndim=2)
    check_tensor("weight", weight, ndim=2, device=x.device)
    check_same_dtype("weight", weight, x.dtype)
    m, k = x.shape
    n, kw = weight.shape
    if kw != k:
        raise ValueError(f"weight: shape {tuple(weight.shape)} does not match x {tuple(x.shape)} (K={k})")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, device=x.device)
        check_same_dtype("bias", bias, x.dtype)
        if bias.shape[0] != n:
            raise ValueError(f"bias: shape {tuple(bias.shape)}, expected ({n},)")
    if swiglu and n % 2:
        raise ValueError(f"weight: {n} rows, expected an even count (gate and up) for swiglu")
    out = torch.empty((m, n // 2 if swiglu else n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        plain = torch.empty((m, n), dtype=x.dtype, device=x.device) if swiglu else out
        plain = plain.zero_() if bias is None else plain.copy_(bias.expand(m, n))
        return _swiglu_after(plain) if swiglu else plain
    cfg = (config if config is not None else _choose(x, weight, bias, planner)).fit_to_device(
        x.element_size(), x.device)
    if cfg.split_k > 1 and not cfg.serial_split:
        if swiglu:
            # No SWIGLU form of the parallel split: its plain result, then the same activation on its pairs.
            return _swiglu_after(bi_linear(x, weight, bias, config=cfg))
        if defer_sum:
            return split_partials(x, weight, bias, cfg)
        return split_launch(x, weight, bias, out, cfg)
    splits = cfg.split_k
    num_tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    if not cfg.persistent:
        programs = num_tiles
    elif x.is_cuda:
        programs = min(num_tiles, num_sms(x.device))
    else:
        programs = min(num_tiles, _INTERPRETER_PROGRAMS)
    # The TMA kernel has no IEEE (full float32) dot: float32 operands keep pointer loads and IEEE dots.
    if cfg.tma and x.dtype != torch.float32 and tma_usable(x, weight):
        return tma_launch(x, weight, bias, out, cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m,
                          cfg.num_warps, cfg.num_stages, programs, swiglu, splits, cfg.flatten)
    _bi_linear_kernel[(programs,)](
        x, weight, bias if bias is not None else x, out,
        m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0, IEEE=x.dtype == torch.float32,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        SWIGLU=int(swiglu), SPLITS=splits, K_PER_SPLIT=split_ranges(k, cfg.block_k, splits),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _choose(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            planner: MatmulPlanner | None) -> MatmulConfig:
    return planner.config(x, weight, bias) if planner is not None else matmul_config(*weight.shape, x.dtype)


def _swiglu_after(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a GEMM output whose columns alternate gate j, up j (kernels/activation.py)."""
    from deepinfer.kernels.activation import silu_and_mul
    from deepinfer.kernels.reference.activation import pairs_to_halves

    return silu_and_mul(pairs_to_halves(h))
