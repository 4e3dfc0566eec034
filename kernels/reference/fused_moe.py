"""Plain-torch reference of kernels/fused_moe.py and the argument checks its wrapper shares.

`fused_moe_ref` is the routed experts' weighted sum computed per (token, slot) in float32 — no sorting,
no grouping — rounded once at the end: independent of how the kernel lays the work out. (The CPU engine
path is kernels/reference/moe.py's experts_ref + combine_experts, which rounds each GEMM to the activation
dtype as transformers does.)

`swiglu_limit` (DeepSeek-V4's clipped SwiGLU, transformers' DeepseekV4Experts._apply_gate) clamps the
pre-activations first: gate <= limit, -limit <= up <= limit. `clip_gate_up` is that clamp on a [M, 2I]
gate|up tensor, shared by the engine's CPU path (engine/layers/hash_moe.py) so both clip the same way.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from deepinfer.kernels._checks import check_same_dtype, check_tensor


def check_fused_moe_args(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                         down: torch.Tensor) -> None:
    """ValueError naming the argument unless the shapes, dtypes, devices and strides fit together."""
    check_tensor("x", x, ndim=2)
    check_tensor("ids", ids, ndim=2, dtypes=(torch.int32, torch.int64), device=x.device)
    check_tensor("weights", weights, ndim=2, dtypes=(torch.float32,), device=x.device)
    check_tensor("gate_up", gate_up, ndim=3, device=x.device)
    check_tensor("down", down, ndim=3, device=x.device)
    check_same_dtype("gate_up", gate_up, x.dtype)
    check_same_dtype("down", down, x.dtype)
    num_tokens, hidden = x.shape
    experts, two_inter, h_in = gate_up.shape
    if ids.shape != weights.shape or ids.shape[0] != num_tokens:
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be "
                         f"[{num_tokens}, top_k]")
    if not weights.is_contiguous() or not ids.is_contiguous():
        raise ValueError("ids and weights must be contiguous; call .contiguous() first")
    if h_in != hidden or two_inter % 2:
        raise ValueError(f"gate_up: shape {tuple(gate_up.shape)}, expected [E, 2 * I, {hidden}]")
    if tuple(down.shape) != (experts, hidden, two_inter // 2):
        raise ValueError(f"down: shape {tuple(down.shape)}, expected {(experts, hidden, two_inter // 2)}")


def check_swiglu_limit(swiglu_limit: float | None) -> None:
    """ValueError unless the clipped-SwiGLU limit is None (plain SwiGLU) or a finite positive number."""
    if swiglu_limit is None:
        return
    if not isinstance(swiglu_limit, (int, float)) or not math.isfinite(swiglu_limit) or swiglu_limit <= 0:
        raise ValueError(f"swiglu_limit={swiglu_limit!r}: give a finite positive float, or None for the "
                         "unclipped SwiGLU")


def clip_gate_up(h: torch.Tensor, limit: float) -> torch.Tensor:
    """h [M, 2I] = [gate | up] -> [min(gate, limit) | clamp(up, -limit, limit)], h's dtype (NaN stays)."""
    gate, up = h.chunk(2, dim=-1)
    return torch.cat([gate.clamp(max=limit), up.clamp(min=-limit, max=limit)], dim=-1)


def fused_moe_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    """sum_k weights[t, k] * down[e] @ (silu(gate[e] @ x[t]) * up[e] @ x[t]), e = ids[t, k].

    float32 inside, rounded once at the end. With `swiglu_limit`, gate and up are clamped (in float32)
    before the activation: silu(min(gate, limit)) * clamp(up, -limit, limit).
    """
    check_fused_moe_args(x, ids, weights, gate_up, down)
    check_swiglu_limit(swiglu_limit)
    xf = x.float()
    inter = gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for k in range(ids.shape[1]):
        for e in torch.unique(ids[:, k]).tolist():
            tok = torch.nonzero(ids[:, k] == e).squeeze(1)
            w = gate_up[e].float()
            gate, up = xf[tok] @ w[:inter].T, xf[tok] @ w[inter:].T
            if swiglu_limit is not None:
                gate, up = gate.clamp(max=swiglu_limit), up.clamp(min=-swiglu_limit, max=swiglu_limit)
            h = F.silu(gate) * up
            out[tok] += weights[tok, k, None] * (h @ down[e].float().T)
    return out.to(x.dtype)
