"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent KV cache, and that cache's layout.

Per token and layer the cache keeps only the compressed latent (kv_lora_rank values, after kv_a_layernorm)
and the shared rope key (qk_rope_head_dim values, after rotation): 576 values for DeepSeek-V3 instead of
2 * 128 heads * 160 for per-head keys and values. Parameters are named as in transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from deepinfer.engine.layers.linear import Linear
from deepinfer.engine.layers.mla_rope import DeepseekRotary
from deepinfer.engine.layers.norm import RMSNorm
from deepinfer.engine.layers.ops import Ops
from deepinfer.engine.models.deepseek_config import MLAConfig
from deepinfer.kernels.metadata import AttentionMetadata
from torch import nn

# transformers builds q_a_layernorm and kv_a_layernorm with the RMSNorm default eps, not rms_norm_eps.
MLA_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLACacheSpec:
    """The latent cache: per layer one tensor [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]."""

    num_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def entry_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token takes over all layers."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return self.num_layers * self.entry_dim * elem

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def allocate(self, num_blocks: int, device: torch.device | str) -> list[torch.Tensor]:
        """Zero-filled per-layer caches (zeros: a masked read of an unused slot never meets a NaN)."""
        shape = (num_blocks, self.block_size, self.entry_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(self.num_layers)]


class MLAttention(nn.Module):
    """q (optionally through the q LoRA), latent + rope key into the cache, attention through `Ops`."""

    def __init__(self, cfg: MLAConfig, hidden_size: int, softmax_scale: float, rotary: DeepseekRotary,
                 ops: Ops, dtype: torch.dtype, device: torch.device | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        self.rotary = rotary
        self.scale = softmax_scale
        heads, qk_dim = cfg.num_heads, cfg.qk_head_dim
        bias = cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(hidden_size, heads * qk_dim, False, ops, dtype, device)
        else:
            self.q_a_proj = Linear(hidden_size, cfg.q_lora_rank, bias, ops, dtype, device)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, MLA_NORM_EPS, ops, dtype, device)
            self.q_b_proj = Linear(cfg.q_lora_rank, heads * qk_dim, False, ops, dtype, device)
        self.kv_a_proj_with_mqa = Linear(hidden_size, cfg.cache_dim, bias, ops, dtype, device)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, MLA_NORM_EPS, ops, dtype, device)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), False,
                                ops, dtype, device)
        self.o_proj = Linear(heads * cfg.v_head_dim, hidden_size, bias, ops, dtype, device)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                cache: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; this step's latents are written at meta.slot_mapping first."""
        cfg = self.cfg
        num_tokens = x.shape[0]
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(num_tokens, cfg.num_heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        cos, sin = rope
        q_pe = self.rotary.rotate(q_pe, cos, sin)
        k_pe = self.rotary.rotate(k_pe.unsqueeze(1), cos, sin).squeeze(1)
        self.ops.store_mla(latent, k_pe, cache, meta.slot_mapping)
        out = self.ops.mla_attention(q_nope, q_pe, cache, meta, self.kv_b_proj.weight, self.scale)
        return self.o_proj(out.reshape(num_tokens, cfg.num_heads * cfg.v_head_dim))
