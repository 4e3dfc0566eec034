"""DeepSeek's rotary embedding for the rope part of MLA: default or YaRN frequencies, optional interleave.

Computed as transformers' DeepseekV3RotaryEmbedding / DeepseekV2RotaryEmbedding compute it (float32
frequencies, cos/sin scaled by YaRN's attention factor), but tabulated once per position so a token's
rotation depends only on its position.
"""

from __future__ import annotations

import math

import torch
from deepinfer.engine.layers.rotary import apply_rotary
from deepinfer.engine.models.deepseek_config import YarnScaling
from torch import nn


def yarn_inv_freq(dim: int, theta: float, yarn: YarnScaling, device: torch.device | None = None
                  ) -> torch.Tensor:
    """YaRN inverse frequencies [dim/2], float32, in the operation order of transformers' yarn init."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (yarn.factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(yarn.original_max_position_embeddings / (num_rotations * 2 * math.pi))
                ) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    index = torch.arange(dim // 2, dtype=torch.float32, device=device)
    ramp = torch.clamp((index - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def default_inv_freq(dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim
    return 1.0 / (theta ** exponent)


class DeepseekRotary(nn.Module):
    """cos/sin lookup by position, and the rotation of MLA's rope parts.

    `interleave`: rotate (x0, x1), (x2, x3), ... pairs and return the rotated pairs de-interleaved as
    [evens | odds] (transformers' V3 `apply_rotary_pos_emb_interleave`; V2's complex multiplication gives
    the same pairs interleaved, a permutation that leaves every q.k product unchanged as long as queries
    and keys share it). Otherwise the rotate_half convention.
    """

    def __init__(self, dim: int, max_positions: int, theta: float, yarn: YarnScaling | None,
                 interleave: bool, upcast: bool, device: torch.device | None = None) -> None:
        super().__init__()
        inv_freq = default_inv_freq(dim, theta, device) if yarn is None else yarn_inv_freq(dim, theta, yarn,
                                                                                             device)
        scale = 1.0 if yarn is None else yarn.cos_sin_scale
        freqs = torch.arange(max_positions, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos() * scale, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * scale, persistent=False)
        self.interleave = interleave
        self.upcast = upcast   # V2 rotates in float32 (complex numbers), V3 in the activation dtype

    @property
    def max_positions(self) -> int:
        return int(self.cos_cache.shape[0])

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, 1, dim], for the tokens at `positions`."""
        dtype = torch.float32 if self.upcast else dtype
        return (self.cos_cache[positions].to(dtype).unsqueeze(1),
                self.sin_cache[positions].to(dtype).unsqueeze(1))

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, dim] rotated (H may be 1: the shared rope key)."""
        out_dtype = x.dtype
        if self.upcast:
            x = x.to(torch.float32)
        if not self.interleave:
            return apply_rotary(x, cos, sin).to(out_dtype)
        half = cos.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(out_dtype)
