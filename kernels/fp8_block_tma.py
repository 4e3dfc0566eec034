"""The block-scaled FP8 GEMM of kernels/fp8_matmul.py (`block_matmul`) with its e4m3 tiles fetched by TMA
instead of per-thread pointer loads; selected by the config key "TMA": 1, for K loops 0 and 1.

Only the way the operand tiles reach shared memory changes: each K step is still one fp8 `tl.dot` with
an fp32 result, scaled by (activation scale of the row) x (weight scale of the column) — both still
loaded by pointer, one per row / column and step — and added to the fp32 accumulator in increasing K
order (K_LOOP 1: the next step's dot issued before the previous step's scaling, the same operations), so
a config gives the same bits with either loader (tests/kernels/test_fp8_block_tma_gpu.py checks it on the
device; benchmarks/fp8_sweep.py reports it per candidate). Out-of-range rows, columns and the K tail are
zero-filled by the TMA unit (the pointer loops' masked loads give zeros there too) and never stored.
K_LOOP 2 (two partial accumulators) has no TMA form: such configs keep pointer loads, as do operands TMA
cannot read (`tma_usable`, kernels/matmul_tma.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepinfer.kernels.gemm_parts import grouped_tile_ids


@triton.jit(do_not_specialize=["M"])
def _block_tma_kernel(a_desc, as_ptr, b_desc, bs_ptr, bias_ptr, out_ptr, M, N, K,
                      stride_asm, stride_bsn, stride_om,
                      HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, K_LOOP: tl.constexpr):
    # The grouped order of the pointer kernel (kernels/fp8_matmul.grouped_tile).
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = grouped_tile_ids(tl.program_id(0), num_pid_m, GROUP_M * tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    as_ptrs = as_ptr + rows * stride_asm
    bs_ptrs = bs_ptr + cols * stride_bsn
    row0 = pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N
    k_tiles = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if K_LOOP == 1:
        # kernels/fp8_matmul._lagged_k_loop's order: step k's dot before step k-1's promotion.
        part = tl.dot(a_desc.load([row0, 0]), b_desc.load([col0, 0]).T)
        a_s = tl.load(as_ptrs)
        b_s = tl.load(bs_ptrs)
        for ki in range(1, k_tiles):
            nxt = tl.dot(a_desc.load([row0, ki * BLOCK_K]), b_desc.load([col0, ki * BLOCK_K]).T)
            acc += part * (a_s[:, None] * b_s[None, :])
            a_s = tl.load(as_ptrs + ki)
            b_s = tl.load(bs_ptrs + ki)
            part = nxt
        acc += part * (a_s[:, None] * b_s[None, :])
    else:
        # kernels/fp8_matmul._scaled_k_loop's order.
        for ki in range(0, k_tiles):
            a = a_desc.load([row0, ki * BLOCK_K])
            b = b_desc.load([col0, ki * BLOCK_K])
            a_s = tl.load(as_ptrs + ki)
            b_s = tl.load(bs_ptrs + ki)
            acc += tl.dot(a, b.T) * (a_s[:, None] * b_s[None, :])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


def block_tma_launch(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None, out: torch.Tensor, cfg: dict[str, int]) -> torch.Tensor:
    """`block_matmul` with TMA tile loads (K_LOOP 0 or 1); the caller checked the shapes and that TMA can
    read xq and weight (`tma_usable`, or the interpreter)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if cfg.get("K_LOOP", 0) not in (0, 1):
        raise ValueError(f"K_LOOP={cfg.get('K_LOOP')}: the TMA block kernel has K loops 0 and 1; use pointer "
                         "loads (no 'TMA' key) for K_LOOP 2")
    m, k = xq.shape
    n = weight.shape[0]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    a_desc = TensorDescriptor(xq, [m, k], [xq.stride(0), 1], [bm, bk])
    b_desc = TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [bn, bk])
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _block_tma_kernel[grid](
        a_desc, xs, b_desc, weight_scale, bias if bias is not None else out, out, m, n, k,
        xs.stride(0), weight_scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
        K_LOOP=cfg.get("K_LOOP", 0), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
