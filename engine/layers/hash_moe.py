"""DeepSeek-V4's MoE block: hash-routed (first layers) or top-k routed experts, clipped SwiGLU, shared expert.

transformers' DeepseekV4SparseMoeBlock. Router scores are `scoring_func(x @ gate.weight^T)` (sqrtsoftplus
by default). A `hash_moe` layer picks its experts by a frozen token-id table (`gate.tid2eid`, a checkpoint
buffer); a `moe` layer by top-k over scores + `e_score_correction_bias`. Either way the chosen experts'
unbiased scores, normalised to sum 1 and times `routed_scaling_factor`, weight their outputs. Every expert
and the shared MLP clip their pre-activations: gate <= limit, -limit <= up <= limit.

Expert weights are fused as transformers holds them (`experts.gate_up_proj` [E, 2I, H],
`down_proj` [E, H, I]) and run through `Ops.routed_experts(..., swiglu_limit=...)`: on CPU the reference
(experts_ref + combine_experts, the clamp in the activation dtype as transformers does), on CUDA the fused
Triton MoE (kernels/fused_moe.py's clipped variant, clamping fp32 accumulators). Chosen experts are sorted
by id, and both paths sum a token's slots in that order (combine_experts; fused_moe's combine kernel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from deepinfer.engine.layers.linear import Linear, empty_param
from deepinfer.engine.layers.ops import Ops
from deepinfer.engine.models.deepseek_v4_config import DeepseekV4Config
from deepinfer.kernels.reference.fused_moe import clip_gate_up
from deepinfer.kernels.reference.pointwise import fixed_path
from torch import nn


def clipped_swiglu(x: torch.Tensor, limit: float, ops: Ops) -> torch.Tensor:
    """x [M, 2I] = [gate | up] -> silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    return ops.silu_and_mul(clip_gate_up(x, limit))


def router_scores(logits: torch.Tensor, scoring_func: str, invariant: bool) -> torch.Tensor:
    """Per-expert scores from router logits [T, E] (float32)."""

    def fn(f, t):
        return fixed_path(f, t) if invariant else f(t)

    if scoring_func == "sqrtsoftplus":
        return fn(torch.sqrt, fn(F.softplus, logits))
    if scoring_func == "sigmoid":
        return fn(torch.sigmoid, logits)
    e = fn(torch.exp, logits - logits.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)


class V4Router(nn.Module):
    """`weight` [E, H]; `tid2eid` [vocab, K] int64 buffer (hash layers) or `e_score_correction_bias` [E]."""

    def __init__(
        self, cfg: DeepseekV4Config, is_hash: bool, ops: Ops, dtype: torch.dtype, device: torch.device | None
    ) -> None:
        super().__init__()
        self.cfg, self.ops, self.is_hash = cfg, ops, is_hash
        self.weight = empty_param(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype, device=device)
        if is_hash:
            self.register_buffer(
                "tid2eid",
                torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int64, device=device),
            )
        else:
            self.e_score_correction_bias = empty_param(
                cfg.n_routed_experts, dtype=torch.float32, device=device
            )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, K] float32, expert ids [T, K] ascending)."""
        cfg = self.cfg
        logits = self.ops.linear(x, self.weight).to(torch.float32)
        scores = router_scores(logits, cfg.scoring_func, self.ops.deterministic)
        if self.is_hash:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = torch.topk(
                scores + self.e_score_correction_bias, cfg.num_experts_per_tok, dim=-1, sorted=False
            ).indices
        ids = ids.sort(dim=-1).values
        weights = scores.gather(1, ids)
        total = weights[:, 0]
        for k in range(1, weights.shape[1]):
            total = total + weights[:, k]
        weights = weights / (total.unsqueeze(-1) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids


class ClippedMLP(nn.Module):
    """The shared expert: gate_proj / up_proj merged into `gate_up_proj`, then `down_proj`, clipped SwiGLU."""

    def __init__(
        self, hidden: int, inter: int, limit: float, ops: Ops, dtype: torch.dtype, device: torch.device | None
    ) -> None:
        super().__init__()
        self.limit, self.ops = limit, ops
        self.gate_up_proj = Linear(hidden, 2 * inter, False, ops, dtype, device)
        self.down_proj = Linear(inter, hidden, False, ops, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clipped_swiglu(self.gate_up_proj(x), self.limit, self.ops))


class V4Experts(nn.Module):
    """The routed experts' weights (checkpoint names `experts.gate_up_proj` / `experts.down_proj`) and their
    clip `limit`; V4MoE runs them through `Ops.routed_experts`."""

    def __init__(
        self, cfg: DeepseekV4Config, ops: Ops, dtype: torch.dtype, device: torch.device | None
    ) -> None:
        super().__init__()
        self.ops, self.limit = ops, cfg.swiglu_limit
        e, inter, hidden = cfg.n_routed_experts, cfg.intermediate_size, cfg.hidden_size
        self.gate_up_proj = empty_param(e, 2 * inter, hidden, dtype=dtype, device=device)
        self.down_proj = empty_param(e, hidden, inter, dtype=dtype, device=device)


class V4MoE(nn.Module):
    """routed(x) + shared_experts(x); the shared expert is one clipped MLP of moe_intermediate_size."""

    def __init__(
        self, cfg: DeepseekV4Config, layer: int, ops: Ops, dtype: torch.dtype, device: torch.device | None
    ) -> None:
        super().__init__()
        self.gate = V4Router(cfg, cfg.mlp_layer_types[layer] == "hash_moe", ops, dtype, device)
        self.experts = V4Experts(cfg, ops, dtype, device)
        self.shared_experts = ClippedMLP(
            cfg.hidden_size, cfg.intermediate_size, cfg.swiglu_limit, ops, dtype, device
        )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        ex = self.experts
        # ids ascending per token (V4Router), weights float32 in the same slot order: the order both the
        # CPU reference and the fused kernel's combine sum in.
        routed = ex.ops.routed_experts(x, ids, weights, ex.gate_up_proj, ex.down_proj, swiglu_limit=ex.limit)
        return routed + self.shared_experts(x)
