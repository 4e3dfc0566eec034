"""Linear layer: holds weight (and optional bias); the matmul lives in the ops backend."""

from __future__ import annotations

import torch
from deepinfer.engine.layers.ops import Ops, QuantizedActivation
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

    @property
    def takes_quantized_rows(self) -> bool:
        """Whether the op producing this layer's input should hand it a QuantizedActivation (rows already
        quantized as `quant_group` says): an FP8 layer on a backend that fuses the activation quantization
        into the producing op."""
        return self.weight.dtype == torch.float8_e4m3fn and self.ops.fuses_fp8_row_quant

    @property
    def quant_group(self) -> int | None:
        """How an FP8 layer's input is quantized: None for one scale per row (one weight scale per output
        channel: the rowwise GEMM), else per token and K-group of this many columns (block-scaled weights:
        the layer's `fp8_group`). None for a layer that is not FP8."""
        if self.weight.dtype != torch.float8_e4m3fn:
            return None
        if self.fp8_scale.shape[1] == 1 and self.fp8_group >= self.weight.shape[1]:
            return None
        return self.fp8_group

    def forward(self, x: torch.Tensor | QuantizedActivation, into_norm: bool = False) -> torch.Tensor:
        """x [M, in_features] (a QuantizedActivation only where `takes_quantized_rows`) -> [M, out].
        `into_norm`: the result goes only into an RMSNorm's `forward_residual`, which also takes what
        `Ops.linear_into_norm` may return instead of a tensor."""
        if self.weight.dtype == torch.float8_e4m3fn:  # FP8 layer: models/quant/fp8_loading.py converted it
            # `fp8_scale_block_n`: set at load where the row scales are equal per aligned 128-row block.
            return self.ops.fp8_linear(x, self.weight, self.fp8_scale, self.bias, self.fp8_group,
                                       scale_block_n=getattr(self, "fp8_scale_block_n", 0))
        if isinstance(x, QuantizedActivation):
            raise ValueError("Linear: a QuantizedActivation input needs an FP8 layer (takes_quantized_rows)")
        if into_norm:
            return self.ops.linear_into_norm(x, self.weight, self.bias)
        return self.ops.linear(x, self.weight, self.bias)
