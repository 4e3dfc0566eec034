"""Expert parallelism for DeepSeek's MoE layer: the routed experts split across ranks, tokens dispatched to
the rank holding their experts and combined back.

Each rank brings its own tokens (attention data parallel beside the experts) and holds experts
[rank * E/W, (rank + 1) * E/W) of the layer; the router and the shared experts are replicated.
`forward(x)` on a rank's tokens:
1. route them locally (row-local math, the same weights on every rank);
2. dispatch: all-gather every rank's tokens and expert ids (padded to the largest count);
3. run this rank's experts on every (token, slot) routed to them, with the layer's row-invariant
   `Ops.linear`, so a token's expert output has the same bits as on one device;
4. combine: all-to-all returns to each rank its tokens' slot outputs from every rank; each slot's value
   is *selected* from the rank owning its expert (no sum across ranks), then the slots are combined in
   expert-id order by the same `combine_experts` the single-device layer uses.
In deterministic mode a token's result is therefore bitwise the single-device layer's, wherever its
experts ran and whatever else was dispatched with it.
"""

from __future__ import annotations

import torch
from deepinfer.engine.layers.moe import DeepseekMoE
from deepinfer.engine.parallel.comm import ParallelGroup
from deepinfer.kernels.reference.moe import combine_experts, experts_ref
from torch import nn


class ExpertParallelMoE(nn.Module):
    """A DeepseekMoE whose routed experts are sharded over `group` (build with `from_layer`)."""

    def __init__(self, gate: nn.Module, shared_experts: nn.Module | None, gate_up: torch.Tensor,
                 down: torch.Tensor, num_experts: int, group: ParallelGroup, ops) -> None:
        super().__init__()
        if num_experts % group.world_size:
            raise ValueError(f"n_routed_experts={num_experts} is not divisible by the expert-parallel size "
                             f"{group.world_size}; choose a size that divides it")
        self.gate = gate
        self.shared_experts = shared_experts
        self.group = group
        self.ops = ops
        self.num_experts = num_experts
        self.per_rank = num_experts // group.world_size
        self.first_expert = group.rank * self.per_rank
        # This rank's experts only: [E/W, 2I, H] and [E/W, H, I].
        self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        self.down_proj = nn.Parameter(down, requires_grad=False)

    @classmethod
    def from_layer(cls, moe: DeepseekMoE, group: ParallelGroup) -> ExpertParallelMoE:
        """This rank's share of a loaded single-device layer (router and shared experts kept as they are)."""
        e = moe.experts.gate_up_proj.shape[0]
        per = e // group.world_size if e % group.world_size == 0 else 0
        lo = group.rank * per
        return cls(moe.gate, moe.shared_experts, moe.experts.gate_up_proj.data[lo:lo + per].clone(),
                   moe.experts.down_proj.data[lo:lo + per].clone(), e, group, moe.experts.ops)

    def _gather_rows(self, t: torch.Tensor, counts: list[int], fill: float) -> torch.Tensor:
        """Every rank's rows of `t` concatenated in rank order (padded to max(counts) for the gather)."""
        width = max(counts)
        pad = t.new_full((width - t.shape[0], *t.shape[1:]), fill)
        parts = self.group.all_gather(torch.cat([t, pad]))
        return torch.cat([p[:n] for p, n in zip(parts, counts)])

    def _local_experts(self, x_all: torch.Tensor, ids_all: torch.Tensor) -> torch.Tensor:
        """[T_all, K, H]: this rank's experts' outputs at the slots routed to them, zeros elsewhere."""
        out = x_all.new_zeros((*ids_all.shape, x_all.shape[-1]))
        local = ids_all - self.first_expert
        tok, slot = torch.nonzero((local >= 0) & (local < self.per_rank), as_tuple=True)
        if tok.numel():
            y = experts_ref(x_all[tok], local[tok, slot].unsqueeze(1), self.gate_up_proj, self.down_proj,
                            linear=self.ops.linear, act=self.ops.silu_and_mul)
            out[tok, slot] = y[:, 0]
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden]: this rank's tokens -> the MoE output [T, hidden] for them."""
        g = self.group
        k = self.gate.cfg.num_experts_per_tok
        if x.shape[0]:
            weights, ids = self.gate(x)
        else:   # a rank without tokens still takes part in every collective
            weights = torch.zeros((0, k), dtype=torch.float32, device=x.device)
            ids = torch.zeros((0, k), dtype=torch.int64, device=x.device)
        counts = [int(c) for c in torch.cat(g.all_gather(torch.tensor([x.shape[0]], device=x.device)))]
        if max(counts) == 0:
            return x.new_zeros(x.shape)
        x_all = self._gather_rows(x, counts, 0.0)
        ids_all = self._gather_rows(ids, counts, -1)
        y_all = self._local_experts(x_all, ids_all)
        starts = [sum(counts[:r]) for r in range(g.world_size)]
        back = g.all_to_all([y_all[s:s + n] for s, n in zip(starts, counts)])   # from every rank, my rows
        owner = ids // self.per_rank                                            # [T, K]: rank of the expert
        stacked = torch.stack(back)                                             # [W, T, K, H]
        rows = torch.arange(x.shape[0], device=x.device).unsqueeze(1)
        slots = torch.arange(ids.shape[1], device=x.device).unsqueeze(0)
        out = combine_experts(stacked[owner, rows, slots], weights)
        if self.shared_experts is not None and x.shape[0]:
            out = out + self.shared_experts(x)
        return out
