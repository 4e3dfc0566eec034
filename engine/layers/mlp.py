"""Gated SiLU MLP with the gate and up projections merged into one matmul."""

from __future__ import annotations

import torch
from deepinfer.engine.layers.linear import Linear
from deepinfer.engine.layers.ops import Ops
from torch import nn


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); `gate_up_proj.weight` rows are [gate | up]."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, ops: Ops, dtype: torch.dtype,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias, ops, dtype, device)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, ops, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
