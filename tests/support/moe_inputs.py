"""Random routed-expert inputs for the fused-MoE GPU tests (bf16 weights and tokens, sorted top-k ids)."""

from __future__ import annotations

import torch


def expert_weights(experts: int, hidden: int, inter: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]) bf16, scaled so pre-activations are ~N(0, 1)."""
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).bfloat16().to(device)
    down = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).bfloat16().to(device)
    return gate_up, down


def routed_tokens(n: int, seed: int, hidden: int, experts: int, top_k: int, device: torch.device,
                  skew: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [n, H] bf16, ids [n, top_k] ascending, weights [n, top_k] float32). `skew` sends most tokens to a
    few experts, so an expert's rows span several row blocks."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=gen).bfloat16().to(device)
    scores = torch.rand(n, experts, generator=gen)
    if skew:
        scores[:, :3] += 1.0
    ids = scores.topk(top_k, dim=-1).indices.sort(dim=-1).values.to(device)
    w = (torch.rand(n, top_k, generator=gen) + 0.1).to(device)
    return x, ids, w
