"""RMSNorm layer: holds the weight; the arithmetic lives in the ops backend."""

from __future__ import annotations

import torch
from deepinfer.engine.layers.linear import empty_param
from deepinfer.engine.layers.ops import Ops, QuantizedActivation
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: Ops, dtype: torch.dtype,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.weight = empty_param(size, dtype=dtype, device=device)
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Norm over the last dim of x [..., size] (leading dims flattened into rows)."""
        shape = x.shape
        return self.ops.rms_norm(x.reshape(-1, shape[-1]), self.weight, self.eps).view(shape)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor | None, quantize: bool = False,
                         group: int | None = None) -> tuple[torch.Tensor | QuantizedActivation, torch.Tensor]:
        """(norm(x + residual), x + residual): the pre-norm transformer's residual step. `quantize`: the
        norm's output quantized for an FP8 linear (the consumer's `takes_quantized_rows`), per row or per
        K-group of `group` (its `quant_group`)."""
        if quantize:
            return self.ops.add_rms_norm_quant(x, residual, self.weight, self.eps, group)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
