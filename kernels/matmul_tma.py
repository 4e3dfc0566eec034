"""The batch-invariant GEMM of kernels/matmul.py with its tiles fetched by TMA (Hopper's tensor memory
accelerator) instead of per-thread pointer loads.

Only the way a tile reaches shared memory changes: each output tile is still one fp32 `tl.dot` chain over
K in BLOCK_K steps, in increasing order, with the same tile shape, so a config gives the same bits with
either loader (kernels/matmul.MatmulPlanner proves this per weight shape before mixing them across M
buckets, as it does for tile shapes; benchmarks/gemm_sweep.py checks it for every candidate). Rows and
columns beyond the tensor are zero-filled by the TMA unit; their results are never stored, and a valid row
only ever meets its own data in the dot, as in the pointer kernel.

TMA needs a 16-byte aligned base, unit inner stride and 16-byte aligned row strides (`tma_usable`);
callers fall back to the pointer kernel otherwise.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from deepinfer.kernels.gemm_parts import grouped_tile_ids, linear_epilogue


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


@triton.jit(do_not_specialize=["M"])
def _bi_linear_tma_kernel(
    x_desc, w_desc, b_ptr, out_ptr,
    M, N, K, stride_om, stride_on,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SWIGLU: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_group = GROUP_M * num_pid_n
    for tile in range(pid, num_tiles, num_programs):
        pid_m, pid_n = grouped_tile_ids(tile, num_pid_m, tiles_per_group, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(0, k_tiles):
            a = x_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
            b = w_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        linear_epilogue(acc, b_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, stride_on, HAS_BIAS, SWIGLU,
                        BLOCK_N)


def tma_launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
               block_m: int, block_n: int, block_k: int, group_m: int, num_warps: int, num_stages: int,
               programs: int, swiglu: bool = False) -> torch.Tensor:
    """out = x @ weight.T (+ bias) with TMA tile loads; the caller checked `tma_usable(x, weight)` and
    chose the config and program count (kernels/matmul.bi_linear); `swiglu`: the SWIGLU epilogue
    (gemm_parts.linear_epilogue), `out` then [M, N / 2]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    n = weight.shape[0]
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [block_m, block_k])
    w_desc = TensorDescriptor(weight, [n, k], [weight.stride(0), 1], [block_n, block_k])
    _bi_linear_tma_kernel[(programs,)](
        x_desc, w_desc, bias if bias is not None else out, out,
        m, n, k, out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, SWIGLU=int(swiglu),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
