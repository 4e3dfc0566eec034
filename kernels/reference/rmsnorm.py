"""Plain-torch RMSNorm: the kernel tests' reference and the CPU engine's implementation.

Written as Hugging Face's LlamaRMSNorm (float32 statistics, cast back to the input dtype, then scaled),
plus the optional residual add before it. With `invariant=True` the rsqrt takes one fixed code path
(see pointwise.fixed_path), so a row's bits never depend on the other rows of the call.
"""

from __future__ import annotations

import torch
from deepinfer.kernels.reference.pointwise import fixed_path


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    invariant: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x [+ residual]) over the last dim; with a residual, also returns the summed input."""
    h = x if residual is None else residual + x
    hf = h.to(torch.float32)
    variance = (hf * hf).mean(-1, keepdim=True) + eps
    inv = fixed_path(torch.rsqrt, variance) if invariant else torch.rsqrt(variance)
    out = weight * (hf * inv).to(h.dtype)
    return out if residual is None else (out, h)
