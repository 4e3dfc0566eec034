"""Linear layer: holds weight (and optional bias); the matmul lives in the ops backend."""

from __future__ import annotations

import torch
from deepinfer.engine.layers.ops import Ops
from torch import nn


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | None = None) -> nn.Parameter:
    """An uninitialised inference parameter (filled by load_weights or init_dummy_weights)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x @ weight^T (+ bias); weight [out_features, in_features] as in torch and HF checkpoints."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: Ops, dtype: torch.dtype,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.ops = ops
        self.weight = empty_param(out_features, in_features, dtype=dtype, device=device)
        if bias:
            self.bias = empty_param(out_features, dtype=dtype, device=device)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.float8_e4m3fn:  # FP8 layer: models/quant/fp8_loading.py converted it
            return self.ops.fp8_linear(x, self.weight, self.fp8_scale, self.bias, self.fp8_group)
        return self.ops.linear(x, self.weight, self.bias)
