"""DeepSeek-V4's partial, interleaved rotary embedding (transformers' DeepseekV4RotaryEmbedding).

Only the trailing `rope_dim` channels of a head rotate, over consecutive (even, odd) pairs, and the result
stays interleaved. cos/sin are computed per position from float32 frequencies, scaled by the rope's
attention factor and rounded to the activation dtype, exactly as the reference computes them; the attention
output's rope slice is rotated back with `-sin` (see v4_attention.py).
"""

from __future__ import annotations

import torch
from deepinfer.engine.layers.mla_rope import default_inv_freq, yarn_inv_freq
from deepinfer.engine.models.deepseek_v4_config import V4Rope
from deepinfer.kernels.reference.pointwise import fixed_path
from torch import nn


class V4Rotary(nn.Module):
    """cos/sin [T, rope_dim / 2] for positions; `invariant` computes them on one fixed code path."""

    def __init__(self, rope: V4Rope, invariant: bool, device: torch.device | None = None) -> None:
        super().__init__()
        dim = rope.rope_dim
        inv = (
            default_inv_freq(dim, rope.theta, device)
            if rope.yarn is None
            else yarn_inv_freq(dim, rope.theta, rope.yarn, device)
        )
        self.register_buffer("inv_freq", inv, persistent=False)
        self.scale = rope.cos_sin_scale
        self.rope_dim = dim
        self.invariant = invariant

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        cos_fn = (lambda t: fixed_path(torch.cos, t)) if self.invariant else torch.cos
        sin_fn = (lambda t: fixed_path(torch.sin, t)) if self.invariant else torch.sin
        return (cos_fn(freqs) * self.scale).to(dtype), (sin_fn(freqs) * self.scale).to(dtype)


def apply_v4_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] channels of x [T, H, D] (cos/sin [T, R/2]); float32 inside."""
    c = cos.repeat_interleave(2, dim=-1).unsqueeze(1).to(torch.float32)
    s = sin.repeat_interleave(2, dim=-1).unsqueeze(1).to(torch.float32)
    r = c.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:]
    rf = rope.to(torch.float32)
    rotated_half = torch.stack((-rf[..., 1::2], rf[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rf * c + rotated_half * s).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)
