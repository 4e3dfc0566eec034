"""The rowwise FP8 GEMM of kernels/fp8_rowwise.py with its e4m3 tiles fetched by TMA (Hopper's tensor memory
accelerator) instead of per-thread pointer loads; selected by the config key "TMA": 1.

Only the way a tile reaches shared memory changes: each output tile is still one fp32 `tl.dot` chain over
K in BLOCK_K steps, in increasing order, with the same tile shape and the same IMPRECISE_ACC, and both
scales multiply the accumulator once in the same epilogue, so a config gives the same bits with either
loader (kernels/fp8_rowwise.RowwisePlanner proves this per weight shape, with the tile changes across M
buckets, before relying on it; benchmarks/fp8_sweep.py reports it for every candidate). Rows, columns and
K beyond the tensor are zero-filled by the TMA unit (the pointer kernel's masked K tail loads zeros too);
out-of-range results are never stored, and a valid row only ever meets its own data in the dot.

BLOCK_K = 128 e4m3 values are 128-byte tile rows, the TMA unit's widest swizzle. TMA needs a 16-byte
aligned base, unit inner stride and 16-byte aligned row strides (K % 16 == 0 here): `tma_usable`
(kernels/matmul_tma.py); the caller falls back to the pointer kernel otherwise. "PERSISTENT": 1 launches
min(#SMs, #tiles) programs looping over the tiles (which program runs a tile never changes its bits);
"FLATTEN": 1 lets Triton software-pipeline that tile loop together with the K loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels._checks import num_sms
from deepinfer.kernels.gemm_parts import grouped_tile_ids, rowwise_epilogue

# Programs of the persistent loop under Triton's CPU interpreter: small, so a program loops over tiles.
_INTERPRETER_PROGRAMS = 3


@triton.jit(do_not_specialize=["M"])
def _rowwise_tma_kernel(a_desc, as_ptr, b_desc, bs_ptr, bias_ptr, out_ptr, M, N, K, stride_bsn, stride_om,
                        HAS_BIAS: tl.constexpr, IMPRECISE_ACC: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        SWIGLU: tl.constexpr = 0, FLATTEN: tl.constexpr = 0):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_group = GROUP_M * num_pid_n
    # FLATTEN: Triton fuses the tile loop with the K loop, so the next tile's loads can start during this
    # tile's epilogue (a schedule change only: the same chains, the same bits).
    for tile in tl.range(pid, num_tiles, num_programs, flatten=FLATTEN):
        # The grouped order of the pointer kernel (kernels/fp8_matmul.grouped_tile), tile by tile.
        pid_m, pid_n = grouped_tile_ids(tile, num_pid_m, tiles_per_group, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(0, k_tiles):
            a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
            b = b_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
            if IMPRECISE_ACC > 0:
                acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=IMPRECISE_ACC)
            else:
                acc = tl.dot(a, b.T, acc)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
        cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
        # The pointer kernel's epilogue: the same scaling order, so the same bits.
        rowwise_epilogue(acc, as_ptr, bs_ptr, bias_ptr, out_ptr, offs_m, offs_n, rows, cols, M, N, stride_bsn,
                         stride_om, HAS_BIAS, SWIGLU, BLOCK_N)


def rowwise_tma_launch(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None, out: torch.Tensor, cfg: dict[str, int],
                       swiglu: bool = False) -> torch.Tensor:
    """out = (xq @ weight^T) * xs * weight_scale^T (+ bias) with TMA tile loads; `swiglu`: the SWIGLU
    epilogue (kernels/fp8_rowwise.py, `rowwise_matmul`). The caller checked shapes and that TMA can read xq
    and weight (`tma_usable`, or the interpreter); `cfg` is a rowwise config."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = xq.shape
    n = weight.shape[0]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    a_desc = TensorDescriptor(xq, [m, k], [xq.stride(0), 1], [bm, bk])
    b_desc = TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [bn, bk])
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    programs = tiles
    if cfg.get("PERSISTENT", 0):
        sms = num_sms(xq.device) if xq.is_cuda else _INTERPRETER_PROGRAMS
        programs = min(tiles, sms)
    _rowwise_tma_kernel[(programs,)](
        a_desc, xs, b_desc, weight_scale, bias if bias is not None else out, out, m, n, k,
        weight_scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, IMPRECISE_ACC=cfg.get("IMPRECISE_ACC", 0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], SWIGLU=int(swiglu),
        FLATTEN=cfg.get("FLATTEN", 0),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
