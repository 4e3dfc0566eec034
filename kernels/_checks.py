"""Argument checks shared by the kernel wrappers (each failure is a ValueError naming the argument), and the
device facts their launches are sized by (`num_sms`, `stages_that_fit`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    ndim: int,
    dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
    device: torch.device | None = None,
    last_dim_contiguous: bool = True,
) -> None:
    """Raise ValueError unless `t` is a tensor of rank `ndim`, one of `dtypes`, on `device`.

    With `last_dim_contiguous`, the last dimension must have stride 1 (the kernels vectorise along it).
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name}: dtype {t.dtype} is not supported (expected one of {allowed})")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: on {t.device}, but the other operands are on {device}")
    if last_dim_contiguous and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name}: last dimension must be contiguous (stride 1), got strides {tuple(t.stride())}; "
            "call .contiguous() first"
        )


def check_same_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name}: dtype {t.dtype} differs from the input dtype {dtype}")


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@functools.cache
def _sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA `device` (device 0 where it names no index), read once per device:
    what persistent loops and split policies size their grids by."""
    return _sms_of(device.index if device.index is not None else 0)


# Shared memory a GEMM program needs beside its pipeline's operand tiles (barriers; an epilogue's layout
# conversion where it does not reuse the tiles' buffers): an allowance, not Triton's exact count.
SMEM_ALLOWANCE = 16 * 1024


@functools.cache
def _smem_of(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 0)


@functools.cache   # per launch on the host's critical path: one lookup (~0.3 us) instead of ~1.8 us
def stages_that_fit(stages: int, stage_bytes: int, device: torch.device) -> int:
    """`stages`, or fewer where the device's shared memory per program cannot hold that many stages of
    `stage_bytes` of operand tiles (plus SMEM_ALLOWANCE): GEMM tables tuned on the H200 (227 KB per
    program) then still launch on an A100 (163 KB) or an L40S (99 KB) instead of failing. The pipeline
    depth never changes a GEMM's bits (each element is the same dot chain), so a table's configs keep
    agreeing. At least 1; unchanged off CUDA, or where torch does not report the limit."""
    if device.type != "cuda":
        return stages
    limit = _smem_of(device.index if device.index is not None else torch.cuda.current_device())
    if not limit:
        return stages
    return max(1, min(stages, (limit - SMEM_ALLOWANCE) // stage_bytes))
