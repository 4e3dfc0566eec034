"""FP8 routed-expert MoE: tokens quantized once, sorted by expert, two grouped FP8 GEMMs, fixed combine.

`fp8_fused_moe` computes sum_k weights[t, k] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])),
e = ids[t, k], with block-scaled e4m3 expert weights (row scales per K-group, models/quant/fp8_experts.py):

1. x is quantized per token and K-group (`quantize_act`, row-local); the first GEMM reads its rows in the
   order of a stable sort of the (token, slot) assignments by expert, in place; the expert offsets come from a
   binary search of the sorted ids (all on the device: no host sync, CUDA-graph capturable).
2. `fp8_grouped_matmul` through gate_up, silu(gate) * up quantized again in one kernel
   (kernels/fp8_group_quant.py, bitwise kernels/activation.py then `quantize_act`), `fp8_grouped_matmul`
   through down.
3. Each token sums its slots' rows of the expert-sorted output in slot order in float32, reading them
   where they lie (kernels/fused_moe.py's `combine_rows`, the bf16 path's combine): no atomics, no gather.

Batch invariance (`invariant=True`): quantization, activation and combine are row-local and the grouped
GEMM's tiles start at each expert's segment with a tile config from the weight shape only, so a token's
bits do not depend on which or how many other tokens share its experts.
"""

from __future__ import annotations

import torch
from deepinfer.kernels._checks import check_tensor
from deepinfer.kernels.fp8_group_quant import silu_and_mul_group_quant
from deepinfer.kernels.fp8_matmul import _check_weight, fp8_grouped_matmul, quantize_act
from deepinfer.kernels.fused_moe import combine_rows

__all__ = ["fp8_fused_moe"]


def fp8_fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor, *,
                  group: int = 128, invariant: bool = True) -> torch.Tensor:
    """x [T, H], ids [T, K] (int), float32 weights [T, K], e4m3 gate_up [E, 2I, H] / down [E, H, I] with
    row scales [E, 2I, H/group] / [E, H, I/group] -> [T, H] in x's dtype (`fp8_moe_ref`'s math)."""
    check_tensor("x", x, ndim=2)
    check_tensor("weights", weights, ndim=2, dtypes=(torch.float32,), device=x.device)
    if ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be "
                         f"[{x.shape[0]}, top_k]")
    num_tokens, top_k = ids.shape
    num_experts = gate_up.shape[0]
    _check_weight(gate_up, gate_up_scale, x.shape[1], group, (num_experts,), x.device)
    _check_weight(down, down_scale, gate_up.shape[1] // 2, group, (num_experts,), x.device)
    if num_tokens == 0:
        return torch.empty_like(x)
    flat = ids.reshape(-1).to(torch.int64)
    order = torch.sort(flat, stable=True).indices
    offsets = torch.searchsorted(flat[order], torch.arange(num_experts + 1, device=x.device))
    xq, xs = quantize_act(x, group)
    # The first GEMM reads each sorted row's token in place (`rows`): no gathered copy of x.
    h = fp8_grouped_matmul(xq, xs, gate_up, gate_up_scale, offsets, x.dtype, group=group,
                           invariant=invariant, rows=order // top_k)
    hq, hs = silu_and_mul_group_quant(h, group)       # bitwise quantize_act(silu_and_mul(h), group)
    y = fp8_grouped_matmul(hq, hs, down, down_scale, offsets, x.dtype, group=group, invariant=invariant)
    back = torch.empty_like(order)                    # (token, slot) -> its row of y
    back[order] = torch.arange(order.shape[0], device=x.device)
    return combine_rows(y, weights, back, torch.empty_like(x))
