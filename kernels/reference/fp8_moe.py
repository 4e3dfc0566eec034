"""Plain-torch reference of the FP8 routed-expert MoE (kernels/fp8_moe.py): dequantize, then matmul.

Each chosen (token, expert) goes through the expert's block-scaled FP8 gate_up [E, 2I, H] and down [E, H, I]
(e4m3 with row scales, models/quant/fp8_tensor.py's engine layout) exactly as `fp8_linear_ref` computes a
dense FP8 layer (activations quantized per token and K-group), silu(gate) * up between the two, and the
slots are combined in slot order (`combine_experts`, as the bf16 MoE does).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from deepinfer.kernels.reference.fp8_matmul import fp8_linear_ref
from deepinfer.kernels.reference.moe import combine_experts


def _silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return (F.silu(gate.to(torch.float32)) * up.to(torch.float32)).to(h.dtype)


def fp8_moe_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor, group: int,
                act: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """x [T, H], ids / float32 weights [T, K] (slots sorted by expert id) -> [T, H] in x's dtype."""
    act = act or _silu_and_mul
    num_tokens, top_k = ids.shape
    out = x.new_zeros((num_tokens, top_k, x.shape[-1]))
    for e in torch.unique(ids).tolist():            # ascending expert id: a fixed order
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        h = act(fp8_linear_ref(x[tok], gate_up[e], gate_up_scale[e], None, group))
        out[tok, slot] = fp8_linear_ref(h, down[e], down_scale[e], None, group)
    return combine_experts(out, weights)
