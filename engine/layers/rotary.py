"""Rotary position embeddings with a precomputed float32 cos/sin table, HF "rotate_half" convention."""

from __future__ import annotations

import math

import torch
from deepinfer.engine.models.config import RopeScaling
from deepinfer.kernels.reference.rotary_store import rotate_half_ref
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None,
                  device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in float32, computed the way transformers computes them."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    band = scaling.high_freq_factor - scaling.low_freq_factor
    smooth = (old_len / wavelen - scaling.low_freq_factor) / band
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """RoPE cos/sin lookup by absolute position.

    The cos/sin table is built once (float32, [max_positions, D]) and only gathered per step, so a
    token's rotation depends on nothing but its position. As in transformers, cos/sin are cast to the
    activation dtype before rotating.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None,
                 device: torch.device | None = None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling, device)
        pos = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, 1, D] in `dtype`, for the tokens at `positions` (gathered once per step)."""
        cos = self.cos_cache[positions].to(dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated with the rotate_half (non-interleaved) convention of transformers.

    The formula lives in kernels/reference/rotary_store.py, the reference the fused rotary + KV-store
    kernel is tested against, so the unfused path and that reference cannot drift apart.
    """
    return rotate_half_ref(x, cos, sin)
