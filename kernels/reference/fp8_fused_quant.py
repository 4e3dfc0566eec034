"""Plain-torch references of kernels/fp8_fused_quant.py and kernels/fp8_group_quant.py: the producing op's
reference, then the quantizer.

Each is the unfused composition the fused kernel replaces: the op's output rounded to its dtype, then
`quantize_act_ref` with one K-group spanning the row (a float32 scale per row, e4m3 values) or with K-groups
of `group` columns (a scale per token and group: the block-scaled GEMM's activations).
"""

from __future__ import annotations

import torch
from deepinfer.kernels.reference.activation import silu_and_mul_ref
from deepinfer.kernels.reference.fp8_matmul import quantize_act_ref
from deepinfer.kernels.reference.rmsnorm import rms_norm_ref


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]): one scale per row."""
    return quantize_act_ref(x, max(x.shape[1], 1))


def rms_norm_quant_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(e4m3 rows, scales [M, 1], x + residual or None) of RMSNorm(x [+ residual]) quantized per row."""
    if residual is None:
        return (*quantize_rows_ref(rms_norm_ref(x, weight, eps)), None)
    out, summed = rms_norm_ref(x, weight, eps, residual)
    return (*quantize_rows_ref(out), summed)


def silu_and_mul_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 rows [M, I], scales [M, 1]) of silu(gate) * up, x [M, 2I] = [gate | up]."""
    return quantize_rows_ref(silu_and_mul_ref(x))


def rms_norm_group_quant_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int,
                             residual: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(e4m3 rows, scales [M, ceil(H / group)], x + residual or None) of RMSNorm(x [+ residual]) quantized
    per token and K-group."""
    if residual is None:
        return (*quantize_act_ref(rms_norm_ref(x, weight, eps), group), None)
    out, summed = rms_norm_ref(x, weight, eps, residual)
    return (*quantize_act_ref(out, group), summed)


def silu_and_mul_group_quant_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 rows [M, I], scales [M, ceil(I / group)]) of silu(gate) * up, x [M, 2I] = [gate | up]."""
    return quantize_act_ref(silu_and_mul_ref(x), group)
