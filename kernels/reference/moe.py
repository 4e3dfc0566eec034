"""DeepSeek MoE routing and expert combination in plain torch (reference and CPU engine path).

Routing follows transformers' DeepseekV3TopkRouter (`route_noaux_tc`: sigmoid scores, bias-corrected
group-limited choice) and DeepseekV2TopkRouter (`route_softmax`: softmax scores, greedy or group-limited
greedy). Both return the chosen experts sorted by expert id, so that the weighted sum over a token's experts
(`combine_experts`) runs in one fixed order, the order transformers' per-expert loop adds them in.

With `invariant=True` every step is row-local with one fixed code path (transcendentals via `fixed_path`,
sums written out term by term: `sum_last`, whose bits a backend's kernel must keep), so a token's routing
and result never depend on the other tokens of the batch. `moe_ref` is the plain end-to-end reference the
layer is tested against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from deepinfer.kernels.reference.pointwise import fixed_path

# `sum_last_in_order` or a kernel with its bits (kernels/row_sum.py): the invariant routers' row sums.
SumLast = Callable[[torch.Tensor], torch.Tensor]


def sum_last_in_order(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim, left to right, one term at a time (no reduction kernel whose split varies).
    kernels/row_sum.py is the same arithmetic in one launch (CUDA backends pass it as `sum_last`)."""
    total = x[..., 0]
    for j in range(1, x.shape[-1]):
        total = total + x[..., j]
    return total


def _group_mask(group_scores: torch.Tensor, topk_group: int, num_experts: int) -> torch.Tensor:
    """bool [T, E]: experts inside the `topk_group` best groups of each row."""
    num_groups = group_scores.shape[-1]
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    return group_mask.unsqueeze(-1).expand(-1, num_groups, num_experts // num_groups).reshape(-1, num_experts)


def _sorted_choice(scores: torch.Tensor, choice: torch.Tensor, top_k: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of `choice` per row, returned as (scores gathered there, expert ids), sorted by expert id."""
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    ids = ids.sort(dim=-1).values
    return scores.gather(1, ids), ids


def route_noaux_tc(logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, n_group: int,
                   topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float, *,
                   invariant: bool = False, sum_last: SumLast = sum_last_in_order
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: float32 router logits [T, E] -> (weights [T, K] float32, expert ids [T, K]).

    Scores are sigmoid(logits); the choice ranks scores + correction_bias, keeping the `topk_group` groups
    whose two best biased scores sum highest; weights are the unbiased scores of the chosen experts,
    normalised to sum 1 when `norm_topk_prob`, times routed_scaling_factor.
    """
    num_tokens, num_experts = logits.shape
    scores = fixed_path(torch.sigmoid, logits) if invariant else logits.sigmoid()
    choice = scores + correction_bias.to(torch.float32)
    best2 = choice.view(num_tokens, n_group, num_experts // n_group).topk(2, dim=-1)[0]
    group_scores = best2[..., 0] + best2[..., 1]
    mask = _group_mask(group_scores, topk_group, num_experts)
    weights, ids = _sorted_choice(scores, choice.masked_fill(~mask, float("-inf")), top_k)
    if norm_topk_prob:
        denom = (sum_last(weights) if invariant else weights.sum(dim=-1)) + 1e-20
        weights = weights / denom.unsqueeze(-1)
    return weights * routed_scaling_factor, ids


def route_softmax(logits: torch.Tensor, top_k: int, topk_method: str, n_group: int | None,
                  topk_group: int | None, routed_scaling_factor: float, *,
                  invariant: bool = False, sum_last: SumLast = sum_last_in_order
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 routing: softmax scores, `greedy` or `group_limited_greedy` top-k, times the scaling.

    group_limited_greedy keeps the `topk_group` groups with the highest single expert score and zeroes the
    others' scores before the top-k (as transformers does). Weights are never renormalised.
    """
    num_tokens, num_experts = logits.shape
    if invariant:
        shifted = logits - logits.amax(dim=-1, keepdim=True)
        exp = fixed_path(torch.exp, shifted)
        scores = exp / sum_last(exp).unsqueeze(-1)
    else:
        scores = logits.softmax(dim=-1, dtype=torch.float32)
    if topk_method == "greedy":
        weights, ids = _sorted_choice(scores, scores, top_k)
    elif topk_method == "group_limited_greedy":
        if n_group is None or topk_group is None:
            raise ValueError("group_limited_greedy routing needs n_group and topk_group")
        group_scores = scores.view(num_tokens, n_group, num_experts // n_group).amax(dim=-1)
        mask = _group_mask(group_scores, topk_group, num_experts)
        masked = scores.masked_fill(~mask, 0.0)
        weights, ids = _sorted_choice(masked, masked, top_k)
    else:
        raise ValueError(f"topk_method={topk_method!r}: expected 'greedy' or 'group_limited_greedy'")
    return weights * routed_scaling_factor, ids


def combine_experts(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_k weights[:, k] * expert_out[:, k] in slot order, float32 inside: [T, K, H] -> [T, H] (out dtype).

    Slots are sorted by expert id (see the routers), which is the order transformers' expert loop
    accumulates in, and the sum is written out term by term so its order never varies.
    """
    total = expert_out[:, 0].to(torch.float32) * weights[:, 0, None]
    for k in range(1, expert_out.shape[1]):
        total = total + expert_out[:, k].to(torch.float32) * weights[:, k, None]
    return total.to(expert_out.dtype)


def experts_ref(x: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
                act: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Each token's chosen experts: x [T, H], ids [T, K] -> outputs [T, K, H] (x's dtype).

    gate_up [E, 2I, H] holds each expert's gate rows then up rows; down [E, H, I]. `linear` and `act`
    (x [M, 2I] -> silu(gate) * up) let a caller supply row-invariant versions; an expert's rows are
    computed together, so only a row-invariant `linear` makes a token's result independent of which other
    tokens chose the same expert.
    """
    if act is None:
        def act(h: torch.Tensor) -> torch.Tensor:
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
    num_tokens, top_k = ids.shape
    out = x.new_zeros((num_tokens, top_k, x.shape[-1]))
    for e in torch.unique(ids).tolist():            # ascending expert id: a fixed order
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        h = act(linear(x[tok], gate_up[e]))
        out[tok, slot] = linear(h, down[e])
    return out


def moe_ref(x: torch.Tensor, router_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
            route: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Plain routed-expert output (no shared experts): float32 router logits, `route`, experts, combine."""
    logits = F.linear(x.to(torch.float32), router_weight.to(torch.float32))
    weights, ids = route(logits)
    return combine_experts(experts_ref(x, ids, gate_up, down), weights)
