"""The numerics stack: what, besides the model, the requests and their seeds, decides an engine's output bits.

In deterministic mode a row's bytes do not depend on its batch, the scheduling or the number of engines,
but they do depend on the machine code that computes them: the device kind and its architecture (an sm_90
GPU runs other instructions and tiles than an sm_80 one; a CPU's GEMMs take their vector ISA's code
path, and MKL takes another path on another vendor's CPU), and the software that produced that code
(torch with its bundled BLAS and CUDA runtime, Triton's compiler). Two engines with the same stack
produce the same bits; the job pipeline records the stack of every committed part and refuses to
resume a deterministic output on another one, whose parts would differ from the committed ones
(pipeline/output/numerics.py).

Left out on purpose: the GPU's product name and memory size (an H100 and an H200 are both sm_90 with
the same kernels and tile tables), the thread count (the CPU engine's batch-invariant forms give the
same bits on 1 and 2 threads: the probes pick the row forms, not how threads split a product) and the
host's driver version (it loads the same PTX/SASS).
"""

from __future__ import annotations

import functools
import importlib.metadata
import platform

import torch


def _dist_version(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "none"


@functools.cache
def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("vendor_id", "CPU implementer"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def numerics_stack(device: torch.device) -> str:
    """One line naming the stack `device` computes with, e.g. ``cuda sm_90, torch 2.11.0+cu130, cuda
    13.0, triton 3.6.0`` or ``cpu x86_64 AVX512 AuthenticAMD, torch 2.13.0+cpu``: equal lines, equal
    bits (module docstring); compared as text, shown to people as is."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return (f"cuda sm_{major}{minor}, torch {torch.__version__}, cuda {torch.version.cuda}, "
                f"triton {_dist_version('triton', 'pytorch-triton')}")
    if device.type == "cpu":
        isa = torch.backends.cpu.get_cpu_capability()
        return f"cpu {platform.machine()} {isa} {_cpu_vendor()}, torch {torch.__version__}"
    return f"{device.type}, torch {torch.__version__}"
