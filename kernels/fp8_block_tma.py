"""The block-scaled FP8 GEMM of kernels/fp8_matmul.py (`block_matmul`) with its e4m3 tiles fetched by TMA
instead of per-thread pointer loads; selected by the config key "TMA": 1, for K loops 0 and 1.

Only the way the operands reach the math changes: each K step is still one fp8 `tl.dot` with an fp32
result, scaled by (activation scale of the row) x (weight scale of the column) and added to the fp32
accumulator in increasing K order (K_LOOP 1: the next step's dot issued before the previous step's
scaling, the same operations), so a config gives the same bits with either loader
(tests/kernels/test_fp8_block_tma_gpu.py checks it on the device; kernels/fp8_block_plan.BlockPlanner
proves it per weight shape before relying on it). Out-of-range rows, columns and the K tail are zero-filled
by the TMA unit (the pointer loops' masked loads give zeros there too) and never stored.

Three things the pointer loop does not do, none of which changes a value:
- the K loop 0 form loads step k+1's scales while step k's tiles are multiplied (the scale loads are not
  pipelined by Triton; their latency otherwise sits in every step);
- TILE_WS (the caller's `scale_block_n`: the weight's row scales are equal within aligned blocks of that
  many rows, as 128 x 128 block checkpoints give them, and BLOCK_N divides it): each tile reads ONE weight
  scale per K step, its first column's, and multiplies it into the row scales (a_s[m] * b_s: the same
  product the outer product forms per element), instead of BLOCK_N gathered scales passed through shared
  memory and BLOCK_M x BLOCK_N multiplies;
- "PERSISTENT": n launches n programs per SM looping over the tiles in the grouped order (which program
  runs a tile never changes its bits).
K_LOOP 2 (two partial accumulators) has no TMA form: such configs keep pointer loads, as do operands TMA
cannot read (`tma_usable`, kernels/matmul_tma.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels._checks import num_sms
from deepinfer.kernels.gemm_parts import grouped_tile_ids

# Programs of the persistent loop under Triton's CPU interpreter: small, so a program loops over tiles.
_INTERPRETER_PROGRAMS = 3



@triton.jit
def _tile_scales(as_ptrs, bs_ptrs, ki):
    """Step ki's row scales [BLOCK_M] and weight scales: [BLOCK_N] per column, or the tile's one (a scalar
    pointer under TILE_WS)."""
    a_s = tl.load(as_ptrs + ki)
    b_s = tl.load(bs_ptrs + ki)
    return a_s, b_s


@triton.jit
def _scale(a_s, b_s, TILE_WS: tl.constexpr):
    """The per-element scale a_s[m] * b_s[n] of a step's dot: one multiply per element either way."""
    if TILE_WS:
        s = (a_s * b_s)[:, None]
    else:
        s = a_s[:, None] * b_s[None, :]
    return s


@triton.jit
def _tma_k_loop(acc, a_desc, b_desc, as_ptrs, bs_ptrs, row0, col0, k_tiles, BLOCK_K: tl.constexpr,
                K_LOOP: tl.constexpr, TILE_WS: tl.constexpr):
    if K_LOOP == 1:
        # kernels/fp8_matmul._lagged_k_loop's order: step k's dot before step k-1's promotion.
        part = tl.dot(a_desc.load([row0, 0]), b_desc.load([col0, 0]).T)
        a_s, b_s = _tile_scales(as_ptrs, bs_ptrs, 0)
        for ki in range(1, k_tiles):
            nxt = tl.dot(a_desc.load([row0, ki * BLOCK_K]), b_desc.load([col0, ki * BLOCK_K]).T)
            acc += part * _scale(a_s, b_s, TILE_WS)
            a_s, b_s = _tile_scales(as_ptrs, bs_ptrs, ki)
            part = nxt
        acc += part * _scale(a_s, b_s, TILE_WS)
    else:
        # kernels/fp8_matmul._scaled_k_loop's order, the next step's scales loaded ahead (the last step
        # reloads its own: in range, never used).
        a_s, b_s = _tile_scales(as_ptrs, bs_ptrs, 0)
        for ki in range(0, k_tiles):
            a = a_desc.load([row0, ki * BLOCK_K])
            b = b_desc.load([col0, ki * BLOCK_K])
            a_next, b_next = _tile_scales(as_ptrs, bs_ptrs, tl.minimum(ki + 1, k_tiles - 1))
            acc += tl.dot(a, b.T) * _scale(a_s, b_s, TILE_WS)
            a_s, b_s = a_next, b_next
    return acc


@triton.jit(do_not_specialize=["M"])
def _block_tma_kernel(a_desc, as_ptr, b_desc, bs_ptr, bias_ptr, out_ptr, M, N, K,
                      stride_asm, stride_bsn, stride_om,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, K_LOOP: tl.constexpr,
                      TILE_WS: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0)):
        # The grouped order of the pointer kernel (kernels/fp8_matmul.grouped_tile).
        pid_m, pid_n = grouped_tile_ids(tile, num_pid_m, GROUP_M * num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
        cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
        if TILE_WS:
            bs_ptrs = bs_ptr + (pid_n * BLOCK_N).to(tl.int64) * stride_bsn
        else:
            bs_ptrs = bs_ptr + cols * stride_bsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _tma_k_loop(acc, a_desc, b_desc, as_ptr + rows * stride_asm, bs_ptrs, pid_m * BLOCK_M,
                          pid_n * BLOCK_N, k_tiles, BLOCK_K, K_LOOP, TILE_WS)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


def block_tma_launch(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None, out: torch.Tensor, cfg: dict[str, int],
                     scale_block_n: int = 0) -> torch.Tensor:
    """`block_matmul` with TMA tile loads (K_LOOP 0 or 1); the caller checked the shapes and that TMA can
    read xq and weight (`tma_usable`, or the interpreter). `scale_block_n` > 0: the caller guarantees the
    weight's row scales are equal within aligned blocks of that many rows (module docstring, TILE_WS)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if cfg.get("K_LOOP", 0) not in (0, 1):
        raise ValueError(f"K_LOOP={cfg.get('K_LOOP')}: the TMA block kernel has K loops 0 and 1; use pointer "
                         "loads (no 'TMA' key) for K_LOOP 2")
    m, k = xq.shape
    n = weight.shape[0]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    a_desc = TensorDescriptor(xq, [m, k], [xq.stride(0), 1], [bm, bk])
    b_desc = TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [bn, bk])
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    programs = tiles
    if cfg.get("PERSISTENT", 0):
        sms = num_sms(xq.device) if xq.is_cuda else _INTERPRETER_PROGRAMS
        programs = min(tiles, sms * cfg["PERSISTENT"])
    _block_tma_kernel[(programs,)](
        a_desc, xs, b_desc, weight_scale, bias if bias is not None else out, out, m, n, k,
        xs.stride(0), weight_scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
        K_LOOP=cfg.get("K_LOOP", 0), TILE_WS=scale_block_n > 0 and scale_block_n % bn == 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
