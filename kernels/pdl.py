"""Programmatic dependent launch (PDL, sm_90+) for the kernels of a decode step.

A 0.5B decode step is ~230 short kernels in one CUDA graph; between two dependent kernels the GPU sits
idle while the next one is launched and its programs are placed (~0.2 ms of a ~2.0 ms step on the H200,
benchmarks/RESULTS.md). A kernel launched with PDL may start while its predecessor's last programs are
still running; it then waits (`griddepcontrol.wait`) until the predecessor has finished and its writes are
visible. Every kernel here that takes PDL calls `wait_for_producers` before it touches memory, so only its
launch and the setup of its programs overlap the predecessor: no read can see stale data and no write can
land under a predecessor's read. The arithmetic is untouched, so every result keeps its bits (checked by
tests/engine/test_cuda_graphs_gpu.py).

`pdl_options(device)` gives the launch arguments: `{}` off CUDA, before sm_90, under the CPU interpreter,
where this Triton lacks the instructions, or with $DEEPINFER_DISABLE_PDL=1 (A/B runs); else the kernel's
PDL constexpr and Triton's `launch_pdl` together, so a kernel never runs launched early without its wait.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:   # Triton >= 3.3 on NVIDIA
    from triton.language.extra.cuda import gdc_wait as _gdc_wait
except ImportError:   # pragma: no cover - older Triton: PDL stays off
    _gdc_wait = None

DISABLE_ENV = "DEEPINFER_DISABLE_PDL"   # 1: plain launches (A/B benchmarks)
_ON = {"PDL": 1, "launch_pdl": True}
_OFF: dict = {}


@triton.jit
def wait_for_producers(PDL: tl.constexpr):
    """First statement of a kernel that may be launched with PDL: block until the kernels it depends on
    have finished and their writes are visible (a no-op when PDL is 0)."""
    if PDL:
        _gdc_wait()


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_options(device: torch.device) -> dict:
    """Launch keyword arguments for a PDL-aware kernel on `device` (read per launch: cheap, and the
    environment switch may change between engines of one process)."""
    if (device.type != "cuda" or _gdc_wait is None or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
            or os.environ.get(DISABLE_ENV, "0") not in ("", "0")):
        return _OFF
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _ON if _capable(index) else _OFF
