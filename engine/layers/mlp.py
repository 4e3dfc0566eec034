"""Gated SiLU MLP with the gate and up projections merged into one matmul."""

from __future__ import annotations

import torch
from deepinfer.engine.layers.linear import Linear
from deepinfer.engine.layers.ops import Ops, QuantizedActivation
from torch import nn


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); `gate_up_proj.weight` rows are [gate | up]."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, ops: Ops, dtype: torch.dtype,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias, ops, dtype, device)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, ops, dtype, device)
        # Set at load (models/quant/fp8_loading.py) where gate_up_proj's rows were reordered for
        # `Ops.fp8_swiglu_linear` / `Ops.swiglu_linear`: gate j and up j alternate, and the SwiGLU runs in the
        # GEMM's epilogue.
        self.swiglu_in_gate_up = False

    def forward(self, x: torch.Tensor | QuantizedActivation, into_norm: bool = False) -> torch.Tensor:
        """x [M, hidden] (or quantized rows, where gate_up_proj takes them) -> [M, hidden]. `into_norm`: as
        `Linear.forward`'s, for the down projection."""
        if self.swiglu_in_gate_up and self.gate_up_proj.weight.dtype != torch.float8_e4m3fn:
            return self.down_proj(self.ops.swiglu_linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias),
                                  into_norm)
        if self.swiglu_in_gate_up:
            a = self.ops.fp8_swiglu_linear(x, self.gate_up_proj.weight, self.gate_up_proj.fp8_scale)
            if not self.down_proj.takes_quantized_rows:
                return self.down_proj(a)
            return self.down_proj(self.ops.quantize(a, self.down_proj.quant_group))
        h = self.gate_up_proj(x)
        if self.down_proj.takes_quantized_rows:   # FP8 down_proj: SiLU-and-mul quantizes for it
            return self.down_proj(self.ops.silu_and_mul_quant(h, self.down_proj.quant_group))
        return self.down_proj(self.ops.silu_and_mul(h), into_norm)
