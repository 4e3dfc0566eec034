"""Which slice of each checkpoint tensor a tensor-parallel rank keeps, and the config of its shard.

Megatron's layout: projections into heads or the MLP's intermediate (q/k/v, q_b/kv_b, gate/up, every
expert's gate/up) are split by output rows (column-parallel: no communication), projections back to the
hidden size (o_proj, down_proj) by input columns (row-parallel: partial sums that `ParallelGroup.reduce_sum`
adds), the embedding and LM head by vocabulary rows (padded to a multiple of the group size). Norms, the
router, and MLA's latent projections (q_a_proj, kv_a_proj_with_mqa) are replicated: every rank keeps the
full latent cache and decompresses its own heads from it.

A rank's shard is an ordinary model of the shard config (fewer heads, a narrower MLP, a vocabulary
slice), so the existing layers and loaders run it unchanged; only the sums across ranks are added
(tp_model.py). Biases of row-parallel layers are kept on rank 0 only (zeros elsewhere), so the sum over
ranks adds them once.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
from deepinfer.engine.models.config import ModelConfig
from deepinfer.engine.models.deepseek_config import DEEPSEEK_ARCHITECTURES, DeepseekConfig
from deepinfer.engine.models.registry import ARCHITECTURES

_MLP = r"\.mlp\.(?:shared_experts\.|experts\.\d+\.)?"
# (pattern, how the tensor is split); a name matching none is replicated.
_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p), kind) for p, kind in (
    (r"^(model\.embed_tokens|lm_head)\.weight$", "vocab"),
    (r"\.self_attn\.(q_proj|k_proj|v_proj|q_b_proj|kv_b_proj)\.(weight|bias)$", "rows"),
    (r"\.self_attn\.o_proj\.weight$", "cols"),
    (r"\.self_attn\.o_proj\.bias$", "rank0"),
    (_MLP + r"(gate|up)_proj\.(weight|bias)$", "rows"),
    (_MLP + r"down_proj\.weight$", "cols"),
    (_MLP + r"down_proj\.bias$", "rank0"),
    (r"\.mlp\.experts\.gate_up_proj(\.weight)?$", "fused_gate_up"),   # [E, 2I, H]: gate rows, then up rows
    (r"\.mlp\.experts\.down_proj(\.weight)?$", "fused_down"),         # [E, H, I]
))


def _split(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"{what}={size} is not divisible by tensor_parallel_size={parts}; choose a "
                         f"tensor_parallel_size that divides it")
    return size // parts


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `size`: its shard config and `shard(name, tensor)` for checkpoint tensors."""

    full: ModelConfig
    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank={self.rank} of size={self.size}: need 0 <= rank < size")
        supported = (*ARCHITECTURES, *DEEPSEEK_ARCHITECTURES)
        if self.size > 1 and self.full.architecture not in supported:
            raise ValueError(f"tensor_parallel_size={self.size} is not supported for "
                             f"{self.full.architecture} yet (supported: {', '.join(sorted(supported))}); "
                             "use tensor_parallel_size=1")
        self.local_config()   # raises on a shape the group size does not divide

    @property
    def vocab_per_rank(self) -> int:
        """Rows of the embedding and LM head each rank holds (the vocabulary padded up to size * this)."""
        return -(-self.full.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def local_config(self) -> ModelConfig:
        """The config of this rank's shard: heads, intermediate sizes and vocabulary divided by `size`."""
        cfg, n = self.full, self.size
        heads = _split(cfg.num_attention_heads, n, "num_attention_heads")
        common = dict(num_attention_heads=heads, intermediate_size=_split(cfg.intermediate_size, n,
                                                                          "intermediate_size"),
                      vocab_size=self.vocab_per_rank)
        if isinstance(cfg, DeepseekConfig):
            moe = dataclasses.replace(cfg.moe, moe_intermediate_size=_split(
                cfg.moe.moe_intermediate_size, n, "moe_intermediate_size"))
            return dataclasses.replace(cfg, **common, num_key_value_heads=heads,
                                       mla=dataclasses.replace(cfg.mla, num_heads=heads), moe=moe)
        kv = _split(cfg.num_key_value_heads, n, "num_key_value_heads")
        return dataclasses.replace(cfg, **common, num_key_value_heads=kv)

    def kind(self, name: str) -> str:
        """How tensor `name` is split: vocab, rows, cols, rank0, fused_gate_up, fused_down or replicate."""
        for pattern, kind in _RULES:
            if pattern.search(name):
                return kind
        return "replicate"

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name` (a view where the split allows one)."""
        kind, n, r = self.kind(name), self.size, self.rank
        if kind == "replicate":
            return tensor
        if kind == "rank0":
            return tensor if r == 0 else torch.zeros_like(tensor)
        if kind == "vocab":
            rows = self.vocab_per_rank
            part = tensor[self.vocab_start:self.vocab_start + rows]
            if part.shape[0] < rows:   # the last rank's slice runs past the vocabulary: zero rows
                part = torch.cat([part, part.new_zeros((rows - part.shape[0], *part.shape[1:]))])
            return part
        if kind == "rows":
            return tensor.chunk(n, dim=0)[r] if _even(tensor, 0, n, name) else tensor
        if kind == "cols":
            return tensor.chunk(n, dim=-1)[r] if _even(tensor, -1, n, name) else tensor
        if kind == "fused_gate_up":
            gate, up = tensor.chunk(2, dim=1)
            _even(gate, 1, n, name)
            return torch.cat([gate.chunk(n, dim=1)[r], up.chunk(n, dim=1)[r]], dim=1)
        if kind == "fused_down":
            return tensor.chunk(n, dim=2)[r] if _even(tensor, 2, n, name) else tensor
        raise AssertionError(kind)


def _even(tensor: torch.Tensor, dim: int, n: int, name: str) -> bool:
    if tensor.shape[dim] % n:
        raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[dim]} along dim {dim}, not divisible "
                         f"by tensor_parallel_size={n}")
    return True
