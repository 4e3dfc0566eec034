"""DeepSeek's routed mixture of experts with shared experts (transformers' DeepseekV3MoE / DeepseekV2Moe).

Expert weights are held fused, as transformers holds them in memory: `experts.gate_up_proj` [E, 2I, H]
(each expert's gate rows then up rows) and `experts.down_proj` [E, H, I]; the loader fills them from
per-expert checkpoint tensors or from fused ones. The routing math is kernels/reference/moe.py.

Determinism: the router logits are a row-invariant float32 matmul, routing is row-local, each expert's
tokens go through row-invariant GEMMs (`Ops.linear` on CPU, the fused MoE kernels' fixed tiles on CUDA: a
token's bits do not depend on which other tokens chose that expert) and a token's experts are summed in
expert-id order, term by term: no atomics, no batch-dependent reduction.
"""

from __future__ import annotations

import torch
from deepinfer.engine.layers.linear import empty_param
from deepinfer.engine.layers.mlp import GatedMLP
from deepinfer.engine.layers.ops import Ops
from deepinfer.engine.models.deepseek_config import MoEConfig
from deepinfer.kernels.reference.moe import experts_ref, route_noaux_tc, route_softmax
from torch import nn


class TopkRouter(nn.Module):
    """`weight` [E, hidden] (float32, as transformers keeps it) and, for noaux_tc, e_score_correction_bias."""

    def __init__(self, cfg: MoEConfig, hidden_size: int, ops: Ops,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        self.weight = empty_param(cfg.n_routed_experts, hidden_size, dtype=torch.float32, device=device)
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = empty_param(cfg.n_routed_experts, dtype=torch.float32,
                                                       device=device)
        else:
            self.register_parameter("e_score_correction_bias", None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, K] float32, expert ids [T, K] sorted ascending per row)."""
        cfg = self.cfg
        logits = self.ops.linear(x.to(torch.float32), self.weight)
        invariant = self.ops.deterministic
        if cfg.topk_method == "noaux_tc":
            return route_noaux_tc(logits, self.e_score_correction_bias, cfg.num_experts_per_tok, cfg.n_group,
                                  cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor,
                                  invariant=invariant, sum_last=self.ops.sum_last_in_order)
        return route_softmax(logits, cfg.num_experts_per_tok, cfg.topk_method, cfg.n_group, cfg.topk_group,
                             cfg.routed_scaling_factor, invariant=invariant,
                             sum_last=self.ops.sum_last_in_order)


class FusedExperts(nn.Module):
    """The routed experts' weights, fused per layer: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""

    def __init__(self, cfg: MoEConfig, hidden_size: int, ops: Ops, dtype: torch.dtype,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.ops = ops
        inter = cfg.moe_intermediate_size
        experts = cfg.n_routed_experts
        self.gate_up_proj = empty_param(experts, 2 * inter, hidden_size, dtype=dtype, device=device)
        self.down_proj = empty_param(experts, hidden_size, inter, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids [T, K] -> each chosen expert's output [T, K, H]."""
        return experts_ref(x, ids, self.gate_up_proj, self.down_proj, linear=self.ops.linear,
                           act=self.ops.silu_and_mul)


class DeepseekMoE(nn.Module):
    """routed(x) + shared_experts(x); shared experts are one gated MLP of n_shared * moe_intermediate."""

    def __init__(self, cfg: MoEConfig, hidden_size: int, mlp_bias: bool, ops: Ops, dtype: torch.dtype,
                 device: torch.device | None = None) -> None:
        super().__init__()
        self.ops = ops
        self.gate = TopkRouter(cfg, hidden_size, ops, device)
        self.experts = FusedExperts(cfg, hidden_size, ops, dtype, device)
        if cfg.n_shared_experts:
            self.shared_experts = GatedMLP(hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                           mlp_bias, ops, dtype, device)
        else:
            self.shared_experts = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        ex = self.experts
        if ex.gate_up_proj.dtype == torch.float8_e4m3fn:
            # FP8 experts (models/quant/fp8_experts.py converted them): grouped FP8 GEMMs on CUDA.
            out = self.ops.routed_experts_fp8(x, ids, weights, ex.gate_up_proj, ex.gate_up_scale,
                                              ex.down_proj, ex.down_scale, ex.fp8_group)
        else:
            # Ops.routed_experts: the reference (experts_ref + combine_experts) on CPU, the fused Triton
            # kernels (kernels/fused_moe.py) on CUDA.
            out = self.ops.routed_experts(x, ids, weights, ex.gate_up_proj, ex.down_proj)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
