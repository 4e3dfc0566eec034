"""`make_ops`: the numeric-ops backend for a device (batch-invariant when deterministic)."""

from __future__ import annotations

import torch
from deepinfer.engine.layers.ops import Ops


def make_ops(device: torch.device | str, deterministic: bool = True) -> Ops:
    """The ops backend for `device`: batch-invariant when `deterministic`, else the fastest simple one.

    CUDA backends import the Triton kernels (deepinfer.kernels) lazily, so CPU use never needs them.
    """
    device = torch.device(device)
    if device.type == "cpu":
        from deepinfer.engine.layers.cpu_ops import CpuFastOps, CpuInvariantOps

        return CpuInvariantOps() if deterministic else CpuFastOps()
    if device.type == "cuda":
        from deepinfer.engine.layers.cuda_ops import CudaFastOps, CudaInvariantOps

        return CudaInvariantOps() if deterministic else CudaFastOps()
    raise ValueError(f"device={device}: deepinfer runs on 'cuda' or 'cpu'")
