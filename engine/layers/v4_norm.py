"""DeepSeek-V4's RMSNorm: float32 weight, float32 statistics and product, one cast at the end.

transformers keeps every V4 norm weight in float32 (`_keep_in_fp32_modules_strict`) and multiplies before
casting back, unlike the Llama-style norm (cast, then multiply) the other models use.
"""

from __future__ import annotations

import torch
from deepinfer.engine.layers.linear import empty_param
from deepinfer.engine.layers.ops import Ops
from torch import nn


class V4RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: Ops, device: torch.device | None = None) -> None:
        super().__init__()
        self.weight = empty_param(size, dtype=torch.float32, device=device)
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Norm over the last dim of x [..., size], returned in x's dtype."""
        shape = x.shape
        out = self.ops.rms_norm(x.reshape(-1, shape[-1]).to(torch.float32), self.weight, self.eps)
        return out.to(x.dtype).view(shape)
