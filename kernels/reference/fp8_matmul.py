"""Plain-torch references of the FP8 GEMMs in kernels/fp8_matmul.py (they dequantize, then matmul).

Formats (as the engine holds FP8 linear layers): weight e4m3 [N, K] with float32 row scales
[N, ceil(K / group)] (a scale per output row and K-group; block checkpoints map onto it exactly);
activations quantized per token and K-group of `group` columns: s = max(amax, EPS) / 448, q = rtne(x / s)
clamped to +-448. `quantize_act_ref` is bitwise what the Triton quantization kernel computes (same float32
operations in the same order); the GEMM references accumulate in float64, so kernels match them within
float32 accumulation tolerance.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Smallest amax a group is scaled for: an all-zero group gets scale EPS / 448 and quantizes to zeros.
ACT_EPS = 1e-10


def quantize_act_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K / group)]), per token and K-group."""
    m, k = x.shape
    groups = -(-k // group)
    xf = x.to(torch.float32)
    padded = torch.nn.functional.pad(xf, (0, groups * group - k)).view(m, groups, group)
    amax = padded.abs().amax(dim=-1)
    scale = torch.clamp(amax, min=ACT_EPS) / FP8_MAX
    q = torch.clamp(padded / scale.unsqueeze(-1), min=-FP8_MAX, max=FP8_MAX).to(FP8_DTYPE)
    return q.view(m, groups * group)[:, :k].contiguous(), scale


def dequantize_rows_ref(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """e4m3 [R, K] with row scales [R, ceil(K / group)] -> float64 [R, K]."""
    k = q.shape[1]
    return q.to(torch.float64) * scale.to(torch.float64).repeat_interleave(group, dim=1)[:, :k]


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None, group: int = 128) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ dequant(weight [N, K])^T (+ bias) with x quantized per token-group."""
    xq, xs = quantize_act_ref(x, group)
    return fp8_linear_quantized_ref(xq, xs, weight, weight_scale, bias, group, x.dtype)


def fp8_linear_quantized_ref(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor,
                             weight_scale: torch.Tensor, bias: torch.Tensor | None, group: int,
                             out_dtype: torch.dtype) -> torch.Tensor:
    """`fp8_linear_ref` on activations already quantized per token-group (xq e4m3 [M, K], xs [M, K/group])."""
    out = dequantize_rows_ref(xq, xs, group) @ dequantize_rows_ref(weight, weight_scale, group).T
    if bias is not None:
        out = out + bias.to(torch.float64)
    return out.to(out_dtype)


def fp8_grouped_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           expert_offsets: torch.Tensor, group: int = 128) -> torch.Tensor:
    """Rows expert_offsets[e]:expert_offsets[e+1] of x [T, K] through expert e of weight [E, N, K]
    (row scales [E, N, ceil(K / group)]) -> [T, N]."""
    out = x.new_zeros((x.shape[0], weight.shape[1]))
    offs = expert_offsets.tolist()
    for e in range(weight.shape[0]):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            out[lo:hi] = fp8_linear_ref(x[lo:hi], weight[e], weight_scale[e], None, group)
    return out


def fp8_rowwise_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """The rowwise-scaled FP8 GEMM (kernels/fp8_rowwise.py): x quantized with one scale per row, weight
    e4m3 [N, K] with one scale per output channel [N, 1]: `fp8_linear_ref` with a single K-group."""
    k = x.shape[1]
    return fp8_linear_ref(x, weight, weight_scale.reshape(-1, 1), bias, group=max(k, 1))
