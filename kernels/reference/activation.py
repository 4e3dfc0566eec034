"""Plain-torch SwiGLU, as HF's LlamaMLP applies it: the kernel tests' reference and the CPU engine's op."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from deepinfer.kernels.reference.pointwise import fixed_path


def pairs_to_halves(h: torch.Tensor) -> torch.Tensor:
    """[M, 2I] with columns alternating gate j, up j (a gate_up GEMM over rows reordered for a SwiGLU
    epilogue) -> [gate | up], the layout silu_and_mul takes."""
    pairs = h.view(h.shape[0], -1, 2)
    return torch.cat([pairs[..., 0], pairs[..., 1]], dim=1)


def silu_and_mul_ref(x: torch.Tensor, *, invariant: bool = False) -> torch.Tensor:
    """x [M, 2I] = [gate | up] -> silu(gate) * up [M, I]; `invariant` fixes silu's code path per element."""
    gate, up = x.chunk(2, dim=-1)
    return (fixed_path(F.silu, gate) if invariant else F.silu(gate)) * up
