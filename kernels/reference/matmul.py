"""Plain-torch matmul reference: float64 accumulation, one rounding."""

from __future__ import annotations

import torch


def bi_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch reference: float64 matmul (+ bias), rounded once to x's dtype (no TF32 involved)."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)
