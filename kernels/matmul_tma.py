"""The batch-invariant GEMM of kernels/matmul.py with its tiles fetched by TMA (Hopper's tensor memory
accelerator) instead of per-thread pointer loads.

Only the way a tile reaches shared memory changes: each output tile is still one fp32 `tl.dot` chain over
K in BLOCK_K steps, in increasing order, with the same tile shape, so a config gives the same bits with
either loader (kernels/matmul.MatmulPlanner proves this per weight shape before mixing them across M
buckets, as it does for tile shapes; benchmarks/gemm_sweep.py checks it for every candidate). Rows and
columns beyond the tensor are zero-filled by the TMA unit; their results are never stored, and a valid row
only ever meets its own data in the dot, as in the pointer kernel.

The fixed-order split-K of kernels/matmul_split.py has both forms here too: the serial one in the main
kernel (SPLITS ranges one after another, their chains summed in range order) and the parallel one's
partials (`tma_split_partials`), each range the same `tma_k_chain` from zero.

TMA needs a 16-byte aligned base, unit inner stride and 16-byte aligned row strides (`tma_usable`);
callers fall back to the pointer kernel otherwise.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from deepinfer.kernels.gemm_parts import grouped_tile_ids, linear_epilogue, split_ranges, store_partial
from deepinfer.kernels.pdl import pdl_options, wait_for_producers


@functools.cache
def _has_tma(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def tma_usable(*tensors: torch.Tensor) -> bool:
    """Whether every tensor can be read through a TMA descriptor on this device. Called per GEMM launch:
    the device's capability is read once per device (the query cost ~8 µs of host time per launch)."""
    for t in tensors:
        if not t.is_cuda or t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if (t.stride(0) * t.element_size()) % 16:
            return False
    index = tensors[0].device.index
    return _has_tma(index if index is not None else torch.cuda.current_device())


@triton.jit
def tma_k_chain(x_desc, w_desc, row0, col0, k_first, k_last, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """The fp32 `tl.dot` chain of output tile (row0, col0) over k-tiles k_first .. k_last - 1 in increasing
    order, from zero: the unsplit kernel's whole chain, or one range of a fixed-order split-K."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(k_first, k_last):
        a = x_desc.load([row0, ki * BLOCK_K])
        b = w_desc.load([col0, ki * BLOCK_K])
        acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def _bi_linear_tma_kernel(
    x_desc, w_desc, b_ptr, out_ptr,
    M, N, K, stride_om, stride_on,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SWIGLU: tl.constexpr = 0, SPLITS: tl.constexpr = 1, K_PER_SPLIT: tl.constexpr = 0, PDL: tl.constexpr = 0,
    FLATTEN: tl.constexpr = 0,
):
    # SPLITS > 1: the serial form of a fixed-order split-K (MatmulConfig.serial_split): the ranges of
    # K_PER_SPLIT k-tiles one after another, each its own chain from zero, summed in range order as they
    # finish: ((p0 + p1) + p2) ..., the bits of the parallel form (_bi_linear_tma_split_kernel + reduce).
    wait_for_producers(PDL)   # kernels/pdl.py: before any load
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_group = GROUP_M * num_pid_n
    # FLATTEN (SPLITS == 1 only): Triton fuses the tile loop with the K loop, so the next tile's loads can
    # start during this tile's epilogue (a schedule change only: the same chains, the same bits).
    for tile in tl.range(pid, num_tiles, num_programs, flatten=FLATTEN):
        pid_m, pid_n = grouped_tile_ids(tile, num_pid_m, tiles_per_group, GROUP_M)
        row0 = pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N
        if SPLITS == 1:
            acc = tma_k_chain(x_desc, w_desc, row0, col0, 0, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            acc = tma_k_chain(x_desc, w_desc, row0, col0, 0, tl.minimum(K_PER_SPLIT, k_tiles),
                              BLOCK_M, BLOCK_N, BLOCK_K)
            for s in tl.static_range(1, SPLITS):
                k_first = s * K_PER_SPLIT
                acc += tma_k_chain(x_desc, w_desc, row0, col0, k_first,
                                   tl.minimum(k_first + K_PER_SPLIT, k_tiles), BLOCK_M, BLOCK_N, BLOCK_K)
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_n = col0 + tl.arange(0, BLOCK_N)
        linear_epilogue(acc, b_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, stride_on, HAS_BIAS, SWIGLU,
                        BLOCK_N)


@triton.jit(do_not_specialize=["M"])
def _bi_linear_tma_split_kernel(
    x_desc, w_desc, part_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    K_PER_SPLIT: tl.constexpr, PDL: tl.constexpr = 0,
):
    wait_for_producers(PDL)
    # The parallel form: program (tile, split) stores its range's chain into the fp32 partials part[split];
    # kernels/matmul_split's reduce sums them in split order.
    tile = tl.program_id(0)
    split = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile_ids(tile, num_pid_m, GROUP_M * num_pid_n, GROUP_M)
    k_first = split * K_PER_SPLIT
    k_last = tl.minimum(k_first + K_PER_SPLIT, tl.cdiv(K, BLOCK_K))
    acc = tma_k_chain(x_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, k_first, k_last,
                      BLOCK_M, BLOCK_N, BLOCK_K)
    store_partial(acc, part_ptr, split, pid_m * BLOCK_M + tl.arange(0, BLOCK_M),
                  pid_n * BLOCK_N + tl.arange(0, BLOCK_N), M, N)


def _descriptors(x: torch.Tensor, weight: torch.Tensor, block_m: int, block_n: int, block_k: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [block_m, block_k])
    w_desc = TensorDescriptor(weight, [weight.shape[0], k], [weight.stride(0), 1], [block_n, block_k])
    return x_desc, w_desc


def tma_launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
               block_m: int, block_n: int, block_k: int, group_m: int, num_warps: int, num_stages: int,
               programs: int, swiglu: bool = False, splits: int = 1, flatten: bool = False) -> torch.Tensor:
    """out = x @ weight.T (+ bias) with TMA tile loads; the caller checked `tma_usable(x, weight)` and
    chose the config and program count (kernels/matmul.bi_linear); `swiglu`: the SWIGLU epilogue
    (gemm_parts.linear_epilogue), `out` then [M, N / 2]; `splits` > 1: the serial form of that fixed-order
    split-K (ranges of `split_ranges(K, block_k, splits)` k-tiles); `flatten`: the tile loop pipelined with
    the K loop (ignored with a serial split)."""
    m, k = x.shape
    n = weight.shape[0]
    x_desc, w_desc = _descriptors(x, weight, block_m, block_n, block_k)
    _bi_linear_tma_kernel[(programs,)](
        x_desc, w_desc, bias if bias is not None else out, out,
        m, n, k, out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, SWIGLU=int(swiglu),
        SPLITS=splits, K_PER_SPLIT=split_ranges(k, block_k, splits), FLATTEN=int(flatten and splits == 1),
        num_warps=num_warps, num_stages=num_stages, **pdl_options(x.device),
    )
    return out


def tma_split_partials(x: torch.Tensor, weight: torch.Tensor, part: torch.Tensor, block_m: int, block_n: int,
                       block_k: int, group_m: int, num_warps: int, num_stages: int) -> torch.Tensor:
    """The parallel form's first half with TMA tile loads: part [splits, M, N] float32 gets each range's
    chain (kernels/matmul_split.split_launch sums them)."""
    m, k = x.shape
    n = weight.shape[0]
    x_desc, w_desc = _descriptors(x, weight, block_m, block_n, block_k)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    _bi_linear_tma_split_kernel[(tiles, part.shape[0])](
        x_desc, w_desc, part, m, n, k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        K_PER_SPLIT=split_ranges(k, block_k, part.shape[0]), num_warps=num_warps, num_stages=num_stages,
        **pdl_options(x.device),
    )
    return part

