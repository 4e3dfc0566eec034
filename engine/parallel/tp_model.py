"""One rank's shard of a tensor-parallel causal LM, with the same interface as an unsharded model.

The shard is the registry's ordinary model built from `ShardPlan.local_config()` (fewer heads, narrower
MLPs, a vocabulary slice), so every layer, kernel and loader runs unchanged. What tensor parallelism adds
lives here: the vocabulary-parallel embedding (each rank looks up the ids in its slice, zeros elsewhere,
summed over ranks: exact, one non-zero term), the row-parallel sums (a forward hook on each attention
`o_proj` and each `mlp` adds the ranks' partial outputs through `ParallelGroup.reduce_sum`; a hook keeps
the layers' parameter names, so the checkpoint loaders see the names they know), and the vocabulary-parallel
LM head (each rank's logits slice, all-gathered: exact). KV heads are split across ranks (each rank caches
only its own heads); MLA's latent cache is replicated (every rank needs the whole latent).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from deepinfer.engine.core.kv_cache import KVCacheSpec, allocate_kv_cache_for
from deepinfer.engine.layers.ops import Ops
from deepinfer.engine.models.config import ModelConfig
from deepinfer.engine.models.registry import build_model
from deepinfer.engine.parallel.comm import ParallelGroup
from deepinfer.engine.parallel.sharding import ShardPlan
from deepinfer.kernels.metadata import AttentionMetadata
from torch import nn


class _SumOverRanks:
    """A forward hook that replaces a module's partial output by its sum over the group's ranks."""

    def __init__(self, group: ParallelGroup) -> None:
        self.group = group

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if not isinstance(output, torch.Tensor):   # Ops.linear_into_norm's deferred sum: reduced first
            output = output.materialize()
        return self.group.reduce_sum(output)


def row_parallel(module: nn.Module, group: ParallelGroup) -> nn.Module:
    """Make `module` (holding its input-dimension shard) row-parallel: its output becomes the sum over ranks.

    Row-parallel biases are loaded on rank 0 only (sharding.py), so they are added once."""
    if group.world_size > 1:
        module.register_forward_hook(_SumOverRanks(group))
    return module


class TensorParallelCausalLM(nn.Module):
    """Rank `group.rank`'s shard of the model of `cfg`; forward / compute_logits as the unsharded model."""

    def __init__(self, cfg: ModelConfig, group: ParallelGroup, ops: Ops, dtype: torch.dtype,
                 device: torch.device, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.plan = ShardPlan(cfg, group.rank, group.world_size)
        self.group = group
        self.ops = ops
        self.dtype = dtype
        self.local = build_model(self.plan.local_config(), ops, dtype, device, max_model_len=max_positions)
        for layer in self.local.model.layers:
            row_parallel(layer.self_attn.o_proj, group)
            # Dense MLP (down_proj partial) or MoE (routed experts' and shared experts' partials): the
            # block's whole output is one partial sum, reduced once.
            row_parallel(layer.mlp, group)

    @property
    def max_positions(self) -> int:
        return self.local.max_positions

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: [T] -> [T, hidden], the same on every rank."""
        weight = self.local.model.embed_tokens.weight
        local_ids = input_ids - self.plan.vocab_start
        inside = (local_ids >= 0) & (local_ids < weight.shape[0])
        x = F.embedding(local_ids.clamp(0, weight.shape[0] - 1), weight)
        x = torch.where(inside.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))
        return self.group.reduce_sum(x)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list) -> torch.Tensor:
        """As PagedCausalLM.forward: final-normed hidden states [T, hidden], replicated on every rank."""
        layers = self.local.model.layers
        if len(kv_caches) != len(layers):
            raise ValueError(f"kv_caches has {len(kv_caches)} entries; the model has {len(layers)} layers")
        x = self.embed(input_ids)
        rope = self.local.rotary(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(layers, kv_caches):
            x, residual = layer(x, residual, rope, meta, kv_cache)
        x, _ = self.local.model.norm.forward_residual(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> float32 logits [S, vocab_size]: each rank's slice, gathered (exact)."""
        part = self.ops.linear(hidden, self.local.lm_head.weight)
        full = torch.cat(self.group.all_gather(part), dim=-1)
        return full[:, : self.config.vocab_size].to(torch.float32)

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype):
        """This rank's cache layout: its own KV heads (or the model's own layout, e.g. MLA's latent)."""
        own = getattr(self.local, "kv_cache_spec", None)
        if own is not None:
            return own(block_size, dtype)
        lc = self.local.config
        return KVCacheSpec(lc.num_hidden_layers, lc.num_key_value_heads, lc.head_dim, block_size, dtype)

    def allocate_kv_cache(self, spec, num_blocks: int, device: torch.device | str) -> list:
        return allocate_kv_cache_for(self.local, spec, num_blocks, torch.device(device))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full checkpoint tensors in, this rank's slices kept (ValueError as the shard's own loader)."""
        self.local.load_weights((name, self.plan.shard(name, t)) for name, t in weights)

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Seeded random weights for the shard (benchmarks). The same seed on every rank, so replicated
        parameters (norms, the router, MLA's latent projections) agree across ranks; the values differ
        from an unsharded model's dummy weights."""
        self.local.init_dummy_weights(seed)
        if self.group.rank:
            with torch.no_grad():
                for name, p in self.local.named_parameters():
                    if self.plan.kind(name) == "rank0":
                        p.zero_()
