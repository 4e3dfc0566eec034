"""The parallel form of the batch-invariant GEMM's fixed-order split-K (MatmulConfig.split_k > 1).

K is cut into `split_k` contiguous ranges of k-tiles whose size depends on K, BLOCK_K and the split count
only (gemm_parts.split_ranges), never on M. Each range is one fp32 `tl.dot` chain from zero, in increasing
k order; the result is ((p0 + p1) + p2) ... (+ bias), rounded once. Here program (tile, range) stores its
chain into fp32 partials and a second kernel sums them in range order: more programs for a decode-sized M
whose output has few tiles (the down projection's long K, a router's narrow N). The serial form (the ranges
one after another inside the tile's program, the sum kept in registers; kernels/matmul.py and
kernels/matmul_tma.py, `MatmulConfig.serial_split`) computes the same sums in the same order without the
partials' memory traffic, the form for prefill-sized M. Both give the same bits, so M buckets may mix them;
the split count itself changes the bits and must be the same in every bucket of a weight. `SplitSum` is the
parallel form's result before the reduce, for a consumer that sums the partials itself (the RMSNorm after
a projection).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from deepinfer.kernels.gemm_parts import grouped_tile_ids, k_chain, split_ranges, store_partial, sum_partials
from deepinfer.kernels.matmul_tma import tma_split_partials, tma_usable
from deepinfer.kernels.pdl import pdl_options, wait_for_producers

if TYPE_CHECKING:
    from deepinfer.kernels.matmul import MatmulConfig


@triton.jit(do_not_specialize=["M"])
def _bi_linear_split_kernel(
    x_ptr, w_ptr, part_ptr,
    M, N, K, K_TILES_PER_SPLIT,
    stride_xm, stride_xk, stride_wn, stride_wk,
    EVEN_K: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Program (tile, split): the fp32 chain of the split's k-tiles, in increasing order, into part[split].
    tile = tl.program_id(0)
    split = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    pid_m, pid_n = grouped_tile_ids(tile, num_pid_m, GROUP_M * num_pid_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)    # as in matmul._bi_linear_kernel: never stored
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    k_first = split * K_TILES_PER_SPLIT
    k_last = tl.minimum(k_first + K_TILES_PER_SPLIT, k_tiles)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + (k_first * BLOCK_K + offs_k[None, :]) * stride_xk
    w_ptrs = w_ptr + cols[None, :] * stride_wn + (k_first * BLOCK_K + offs_k[:, None]) * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The same chain as matmul._bi_linear_kernel's (one helper), over this split's k-tiles.
    acc = k_chain(acc, x_ptrs, w_ptrs, offs_k, K, k_first, k_last, stride_xk, stride_wk, EVEN_K, IEEE,
                  BLOCK_K)
    store_partial(acc, part_ptr, split, offs_m, offs_n, M, N)


@triton.jit(do_not_specialize=["M"])
def _split_reduce_kernel(part_ptr, b_ptr, out_ptr, M, N, stride_om, stride_on,
                         SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = 0):
    wait_for_producers(PDL)
    # out = ((part[0] + part[1]) + part[2]) + ... (+ bias): the same order for every element and every M.
    total = M.to(tl.int64) * N
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    m = offs // N
    n = offs % N
    acc = sum_partials(part_ptr, offs, ok, total, b_ptr, n, SPLITS, HAS_BIAS)
    tl.store(out_ptr + m * stride_om + n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class SplitSum:
    """A parallel split-K's result before its reduce: x @ weight.T (+ bias) is, element by element,
    ((part[0] + part[1]) + ...) (+ bias) in float32, rounded to `dtype` (`gemm_parts.sum_partials`).

    `bi_linear(..., defer_sum=True)` hands this to a consumer that sums the partials itself, in that order
    (kernels/rmsnorm.py's `rms_norm`: the residual add and norm after the projection), so the reduce's
    launch and its output's round trip through memory are saved and the bits are the reduce's. Any other
    consumer calls `materialize`."""

    part: torch.Tensor             # [splits, M, N] float32, contiguous: each range's fp32 chain
    bias: torch.Tensor | None      # [N] in `dtype`, added once after the partials
    dtype: torch.dtype             # the GEMM's output dtype (its input's)

    @property
    def shape(self) -> torch.Size:
        return self.part.shape[1:]

    @property
    def device(self) -> torch.device:
        return self.part.device

    def materialize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The sum as a [M, N] tensor of `dtype` (into `out` when given): the split-K's reduce."""
        splits, m, n = self.part.shape
        if out is None:
            out = torch.empty((m, n), dtype=self.dtype, device=self.part.device)
        if m * n == 0:
            return out
        block = 1024
        _split_reduce_kernel[(triton.cdiv(m * n, block),)](
            self.part, self.bias if self.bias is not None else self.part, out, m, n, out.stride(0),
            out.stride(1), SPLITS=splits, HAS_BIAS=self.bias is not None, BLOCK=block, num_warps=4,
            **pdl_options(self.part.device),
        )
        return out


def split_partials(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: MatmulConfig
                   ) -> SplitSum:
    """x @ weight.T (+ bias) by the parallel form of `cfg`'s split-K, before its reduce: each range's fp32
    chain (TMA tile loads where cfg.tma and the operands allow, else pointer loads: the same chains)."""
    m, k = x.shape
    n = weight.shape[0]
    part = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
    if cfg.tma and x.dtype != torch.float32 and tma_usable(x, weight):
        tma_split_partials(x, weight, part, cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m,
                           cfg.num_warps, cfg.num_stages)
    else:
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        _bi_linear_split_kernel[(tiles, cfg.split_k)](
            x, weight, part, m, n, k, split_ranges(k, cfg.block_k, cfg.split_k),
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
            EVEN_K=k % cfg.block_k == 0, IEEE=x.dtype == torch.float32,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return SplitSum(part, bias, x.dtype)


def split_launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                 cfg: MatmulConfig) -> torch.Tensor:
    """out = x @ weight.T (+ bias) by the parallel form of `cfg`'s split-K: the partials, then their
    ordered sum."""
    return split_partials(x, weight, bias, cfg).materialize(out)
