"""FP8 GEMMs with block scales: out = x @ dequant(weight)^T, x quantized per token and K-group on the fly.

`quantize_act` (a small Triton kernel) turns x [M, K] into e4m3 plus one float32 scale per token and K-group
of GROUP columns; `fp8_linear` multiplies it with an e4m3 weight [N, K] holding row scales [N, K/GROUP]
(the engine's layout, models/quant/fp8_tensor.py): each K step of BLOCK_K = GROUP is one fp8 `tl.dot` with
fp32 result, scaled by (activation scale of the row) x (weight scale of the column) and added to an fp32
accumulator. `fp8_grouped_linear` is the same per expert over expert-sorted rows (MoE).

Batch invariance (`invariant=True`, deterministic mode): the quantization is row-local, and the GEMM's tile
config is a function of (N, K, GROUP) only, K is walked in increasing order with no split-K, rows past M
read row 0 and are never stored; so a row's bits do not depend on M or on the other rows. `M` is not
specialised on, so one binary serves every M. The fast mode picks the tile height from M.

Three K loops (config key K_LOOP, compared by benchmarks/bench_fp8.py --sweep; 0 stays the default until
measured slower): 0 scales each step's dot into the accumulator right after it; 1 issues step k's dot
before step k-1's scaling (software-pipelined promotion): the same float32 operations in the same order,
so the same bits as 0 (the sweep checks it on the device); 2 keeps two partial accumulators (even / odd
steps, other bits, still batch-invariant).
Tile loads: "TMA": 1 in a config fetches the e4m3 tiles by TMA descriptors (kernels/fp8_block_tma.py, K
loops 0 and 1; also its persistent loop and one weight scale per tile) where the device and operands allow,
else by pointer loads: the same operations, so the same bits. The engine's M-bucket configs and their
proof live in kernels/fp8_block_plan.py (BlockPlanner); `fp8_linear` here keeps the single config.
Per-channel / per-tensor weights take the rowwise kernel instead (kernels/fp8_rowwise.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels._checks import check_tensor
from deepinfer.kernels.e4m3 import e4m3_quotient
from deepinfer.kernels.fp8_block_tma import block_tma_launch
from deepinfer.kernels.gemm_parts import grouped_tile_ids
from deepinfer.kernels.matmul_tma import tma_usable
from deepinfer.kernels.reference.fp8_matmul import ACT_EPS, FP8_DTYPE, FP8_MAX

__all__ = ["quantize_act", "fp8_linear", "fp8_grouped_linear", "fp8_grouped_matmul", "fp8_tile_config",
           "block_matmul"]


@triton.jit(do_not_specialize=["M"])
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm,
                      GROUP: tl.constexpr, ROWS: tl.constexpr, EPS: tl.constexpr, QMAX: tl.constexpr,
                      HW: tl.constexpr):
    # ROWS rows x one K-group per program: each element's arithmetic is the same as one row at a time
    # (the group max is exact), so the bits do not depend on ROWS; it only cuts the program count.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, GROUP)
    mask = (rows[:, None] < M) & (offs[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), EPS) / QMAX
    q = e4m3_quotient(x, scale[:, None], QMAX, HW)
    tl.store(q_ptr + rows[:, None] * stride_qm + offs[None, :],
             q.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(s_ptr + rows * stride_sm + g, scale, mask=rows < M)


# Rows per quantization program (measured on the H200: one row per program made the quantization of a
# 2048 x 14336 activation cost 150 us, most of an FP8 GEMM's time).
_QUANT_ROWS = 16


def quantize_act(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K / group)]); bitwise `quantize_act_ref`."""
    check_tensor("x", x, ndim=2)
    m, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m and k:
        _act_quant_kernel[(triton.cdiv(m, _QUANT_ROWS), groups)](
            x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0),
            GROUP=group, ROWS=_QUANT_ROWS, EPS=ACT_EPS, QMAX=FP8_MAX, HW=x.is_cuda, num_warps=4)
    return q, s


def fp8_tile_config(m: int | None, n: int, k: int, group: int) -> dict[str, int]:
    """Tile config: from (N, K, GROUP) only when `m` is None (invariant), else also from M (fast).

    64x128 tiles, 4 warps, 3 stages: the best (or within 1% of it) of 32 configs swept on the H200 for the
    Llama-3.1-8B layer shapes at M = 256 and M = 2048, kernel time in CUDA graphs (larger tiles lose: the
    per-K-step rescale of the accumulator keeps the dot from pipelining), so both modes use it for every M.
    """
    del m, n, k  # kept in the signature so an (M, N, K)-dependent policy can return
    return _block_cfg(64, 128, group, 4, 3, 0)


def _block_cfg(bm: int, bn: int, group: int, warps: int, stages: int, k_loop: int) -> dict[str, int]:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": group, "GROUP_M": 8, "num_warps": warps,
            "num_stages": stages, "K_LOOP": k_loop}


@triton.jit
def _scaled_k_loop(acc, a_ptrs, b_ptrs, as_ptrs, bs_ptrs, K, stride_ak, stride_bk,
                   BLOCK_K: tl.constexpr):
    offs_k = tl.arange(0, BLOCK_K)
    for ki in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - ki * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        a_s = tl.load(as_ptrs + ki)
        b_s = tl.load(bs_ptrs + ki)
        acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _lagged_k_loop(acc, a_ptrs, b_ptrs, as_ptrs, bs_ptrs, K, stride_ak, stride_bk,
                   BLOCK_K: tl.constexpr):
    # K_LOOP=1: step k's dot is issued before step k-1's promotion FMA, so the tensor cores work on the
    # next product while the previous one is scaled into the accumulator (the default loop must wait for
    # each dot before its FMA). Same products, same scales, same FMA order: bitwise the default loop.
    offs_k = tl.arange(0, BLOCK_K)
    a = tl.load(a_ptrs, mask=offs_k[None, :] < K, other=0.0)
    b = tl.load(b_ptrs, mask=offs_k[:, None] < K, other=0.0)
    part = tl.dot(a, b)
    # The scales travel as vectors (a [BLOCK_M, BLOCK_N] scale tile would cost another accumulator's worth
    # of registers); the outer product is formed in the FMA, as in the default loop.
    a_s = tl.load(as_ptrs)
    b_s = tl.load(bs_ptrs)
    for ki in range(1, tl.cdiv(K, BLOCK_K)):
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
        k_left = K - ki * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        nxt = tl.dot(a, b)
        acc += part * (a_s[:, None] * b_s[None, :])
        a_s = tl.load(as_ptrs + ki)
        b_s = tl.load(bs_ptrs + ki)
        part = nxt
    acc += part * (a_s[:, None] * b_s[None, :])
    return acc


@triton.jit
def _paired_k_loop(acc, a_ptrs, b_ptrs, as_ptrs, bs_ptrs, K, BLOCK_K: tl.constexpr):
    # K_LOOP=2: even and odd K steps go to two partial accumulators (two independent dots in flight per
    # promotion), summed once at the end. Other bits than loops 0/1 (another summation order), but the
    # order is fixed by K alone, so still batch-invariant.
    offs_k = tl.arange(0, BLOCK_K)
    steps = tl.cdiv(K, BLOCK_K)
    acc_odd = tl.zeros_like(acc)
    for ki in range(0, tl.cdiv(steps, 2)):
        k0 = 2 * ki * BLOCK_K
        a0 = tl.load(a_ptrs + k0, mask=offs_k[None, :] < K - k0, other=0.0)
        b0 = tl.load(b_ptrs + k0, mask=offs_k[:, None] < K - k0, other=0.0)
        a1 = tl.load(a_ptrs + k0 + BLOCK_K, mask=offs_k[None, :] < K - k0 - BLOCK_K, other=0.0)
        b1 = tl.load(b_ptrs + k0 + BLOCK_K, mask=offs_k[:, None] < K - k0 - BLOCK_K, other=0.0)
        d0 = tl.dot(a0, b0)
        d1 = tl.dot(a1, b1)
        acc += d0 * (tl.load(as_ptrs + 2 * ki)[:, None] * tl.load(bs_ptrs + 2 * ki)[None, :])
        # Past the last step d1 is all zeros: any in-range scale (the last) keeps acc_odd unchanged.
        odd = tl.minimum(2 * ki + 1, steps - 1)
        acc_odd += d1 * (tl.load(as_ptrs + odd)[:, None] * tl.load(bs_ptrs + odd)[None, :])
    return acc + acc_odd


@triton.jit
def _k_loop(acc, a_ptrs, b_ptrs, as_ptrs, bs_ptrs, K, BLOCK_K: tl.constexpr, K_LOOP: tl.constexpr):
    if K_LOOP == 1:
        acc = _lagged_k_loop(acc, a_ptrs, b_ptrs, as_ptrs, bs_ptrs, K, 1, 1, BLOCK_K)
    elif K_LOOP == 2:
        acc = _paired_k_loop(acc, a_ptrs, b_ptrs, as_ptrs, bs_ptrs, K, BLOCK_K)
    else:
        acc = _scaled_k_loop(acc, a_ptrs, b_ptrs, as_ptrs, bs_ptrs, K, 1, 1, BLOCK_K)
    return acc


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Output tile `pid` of an [M, N] GEMM in grouped order (GROUP_M row tiles share the weight tiles they
    read while those are in L2): (offs_m, offs_n, rows, cols), where rows / cols past M / N read row /
    column 0 (int64), so the K loop needs no mask on them and those results are never stored."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = grouped_tile_ids(pid, num_pid_m, GROUP_M * tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    return offs_m, offs_n, rows, cols


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, out_ptr, M, N, K,
                     stride_am, stride_asm, stride_bn, stride_bsn, stride_om,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, K_LOOP: tl.constexpr):
    offs_m, offs_n, rows, cols = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _k_loop(acc, a_ptr + rows[:, None] * stride_am + offs_k[None, :],
                  b_ptr + cols[None, :] * stride_bn + offs_k[:, None],
                  as_ptr + rows * stride_asm, bs_ptr + cols * stride_bsn, K, BLOCK_K, K_LOOP)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check_weight(weight: torch.Tensor, scale: torch.Tensor, k: int, group: int, lead: tuple[int, ...],
                  device: torch.device) -> None:
    check_tensor("weight", weight, ndim=len(lead) + 2, dtypes=(FP8_DTYPE,), device=device)
    check_tensor("weight_scale", scale, ndim=len(lead) + 2, dtypes=(torch.float32,), device=device)
    if weight.shape[-1] != k:
        raise ValueError(f"weight: shape {tuple(weight.shape)} does not match K={k}")
    want = (*weight.shape[:-1], triton.cdiv(k, group))
    if tuple(scale.shape) != want:
        raise ValueError(f"weight_scale: shape {tuple(scale.shape)}, expected {want} (row scales per "
                         f"K-group of {group})")
    if group < 16 or group & (group - 1):
        raise ValueError(f"group={group}: must be a power of two >= 16")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, *, group: int = 128, invariant: bool = True,
               config: dict[str, int] | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(weight [N, K], weight_scale [N, K/group])^T (+ bias [N]) -> [M, N] in x's dtype.

    `invariant`: the batch-invariant tile config (deterministic mode); `config` overrides it (benchmarks).
    """
    check_tensor("x", x, ndim=2)
    m, k = x.shape
    _check_weight(weight, weight_scale, k, group, (), x.device)
    n = weight.shape[0]
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    xq, xs = quantize_act(x, group)
    cfg = {**(config or fp8_tile_config(None if invariant else m, n, k, group)), "BLOCK_K": group}
    return block_matmul(xq, xs, weight, weight_scale, bias, x.dtype, cfg)


def block_matmul(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype, config: dict[str, int],
                 scale_block_n: int = 0) -> torch.Tensor:
    """The GEMM alone on rows quantized by `quantize_act` (group = config["BLOCK_K"]); benchmarks time it
    without the quantization. `scale_block_n` > 0 promises the weight's row scales are equal within aligned
    blocks of that many rows: TMA configs whose BLOCK_N divides it read one weight scale per tile and step
    (the same values; kernels/fp8_block_tma.py), unless the config says "COL_SCALES": 1."""
    cfg = config
    m, k = xq.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    if cfg.get("TMA", 0) and cfg.get("K_LOOP", 0) in (0, 1) and tma_usable(xq, weight):
        return block_tma_launch(xq, xs, weight, weight_scale, bias, out, cfg,
                                0 if cfg.get("COL_SCALES", 0) else scale_block_n)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _fp8_gemm_kernel[grid](
        xq, xs, weight, weight_scale, bias if bias is not None else out, out, m, n, k,
        xq.stride(0), xs.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg["GROUP_M"], K_LOOP=cfg.get("K_LOOP", 0), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out


@triton.jit
def _fp8_grouped_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr, tile_expert_ptr, tile_start_ptr,
                        tile_end_ptr, a_rows_ptr, N, K, stride_am, stride_asm, stride_be, stride_bn,
                        stride_bse, stride_bsn, stride_om, NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_LOOP: tl.constexpr,
                        GATHER: tl.constexpr):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < NUM_EXPERTS:
        start = tl.load(tile_start_ptr + tile)
        end = tl.load(tile_end_ptr + tile)
        offs_m = start + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.where(offs_m < end, offs_m, start).to(tl.int64)  # the tile's own first row: never stored
        if GATHER:   # sorted row i reads row a_rows[i] of a (and of its scales): no gathered copy of a
            rows = tl.load(a_rows_ptr + rows).to(tl.int64)
        cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        e = expert.to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _k_loop(acc, a_ptr + rows[:, None] * stride_am + offs_k[None, :],
                      b_ptr + e * stride_be + cols[None, :] * stride_bn + offs_k[:, None],
                      as_ptr + rows * stride_asm, bs_ptr + e * stride_bse + cols * stride_bsn,
                      K, BLOCK_K, K_LOOP)
        mask = (offs_m[:, None] < end) & (offs_n[None, :] < N)
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


def _tile_map(expert_offsets: torch.Tensor, num_tokens: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per M-tile (expert, first row, end row), built on the device (no host sync, graph-capturable).
    Sized for the worst case cdiv(T, BLOCK_M) + E tiles; unused tiles carry expert E and do nothing."""
    offs = expert_offsets.to(torch.int64)
    num_experts = offs.shape[0] - 1
    tiles = (offs[1:] - offs[:-1] + block_m - 1) // block_m
    cum = torch.cumsum(tiles, 0)
    idx = torch.arange(triton.cdiv(num_tokens, block_m) + num_experts, device=offs.device)
    expert = torch.searchsorted(cum, idx, right=True)
    e = expert.clamp(max=num_experts - 1)
    start = offs[e] + (idx - (cum - tiles)[e]) * block_m
    return expert.to(torch.int32), start, offs[e + 1]


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       expert_offsets: torch.Tensor, *, group: int = 128, invariant: bool = True,
                       config: dict[str, int] | None = None) -> torch.Tensor:
    """Expert-sorted x [T, K] (rows expert_offsets[e]:expert_offsets[e+1] belong to expert e) through
    weight [E, N, K] with row scales [E, N, K/group] -> [T, N]. A row's bits depend only on the row and
    its expert (tiles start at each expert segment), so with `invariant` it is batch-invariant."""
    check_tensor("x", x, ndim=2)
    t, k = x.shape
    _check_weight(weight, weight_scale, k, group, (weight.shape[0],), x.device)
    num_experts = weight.shape[0]
    if expert_offsets.shape != (num_experts + 1,):
        raise ValueError(f"expert_offsets: shape {tuple(expert_offsets.shape)}, expected "
                         f"({num_experts + 1},)")
    if t == 0 or weight.shape[1] == 0:
        return torch.empty((t, weight.shape[1]), dtype=x.dtype, device=x.device)
    xq, xs = quantize_act(x, group)
    return fp8_grouped_matmul(xq, xs, weight, weight_scale, expert_offsets, x.dtype, group=group,
                              invariant=invariant, config=config)


def fp8_grouped_matmul(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       expert_offsets: torch.Tensor, out_dtype: torch.dtype, *, group: int = 128,
                       invariant: bool = True, config: dict[str, int] | None = None,
                       rows: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_grouped_linear` on rows already quantized by `quantize_act` (xq e4m3, xs [., K/group]): the MoE
    quantizes each token once (kernels/fp8_moe.py). With `rows` (int64 [T]), sorted row i is row rows[i]
    of xq / xs (read in place, the same bits as gathering them first); else xq's T rows are the sorted
    rows."""
    t, k = (xq.shape[0] if rows is None else rows.shape[0]), xq.shape[1]
    if rows is not None and (rows.dtype != torch.int64 or rows.ndim != 1 or rows.device != xq.device):
        raise ValueError(f"rows: expected an int64 vector on {xq.device}, got {rows.dtype} "
                         f"{tuple(rows.shape)} on {rows.device}")
    num_experts, n = weight.shape[0], weight.shape[1]
    out = torch.empty((t, n), dtype=out_dtype, device=xq.device)
    if t == 0 or n == 0:
        return out
    cfg = config or fp8_tile_config(None if invariant else t, n, k, group)
    tile_expert, tile_start, tile_end = _tile_map(expert_offsets, t, cfg["BLOCK_M"])
    grid = (tile_expert.shape[0], triton.cdiv(n, cfg["BLOCK_N"]))
    _fp8_grouped_kernel[grid](
        xq, xs, weight, weight_scale, out, tile_expert, tile_start, tile_end,
        rows if rows is not None else tile_start, n, k,   # tile_start: unread unless GATHER
        xq.stride(0), xs.stride(0), weight.stride(0), weight.stride(1), weight_scale.stride(0),
        weight_scale.stride(1), out.stride(0), NUM_EXPERTS=num_experts, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=group, K_LOOP=cfg.get("K_LOOP", 0), GATHER=rows is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
