"""DeepSeek-V2/V3 causal LMs (transformers' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM).

Pre-norm decoder layers of multi-head latent attention (engine/layers/mla.py) and either a dense gated MLP
(the first `first_k_dense_replace` layers) or the routed MoE with shared experts (engine/layers/moe.py).
The model chooses its own KV-cache layout (`kv_cache_spec` / `allocate_kv_cache`): one latent cache tensor
per layer instead of per-head keys and values.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from deepinfer.engine.layers.mla import MLACacheSpec, MLAttention
from deepinfer.engine.layers.mla_rope import DeepseekRotary
from deepinfer.engine.layers.mlp import GatedMLP
from deepinfer.engine.layers.moe import DeepseekMoE
from deepinfer.engine.layers.norm import RMSNorm
from deepinfer.engine.layers.ops import Ops
from deepinfer.engine.models.deepseek_config import DEEPSEEK_V2, DeepseekConfig
from deepinfer.engine.models.deepseek_weights import load_deepseek_weights
from deepinfer.engine.models.stack import PagedCausalLM, PreNormDecoderLayer, embedding_table, lm_head
from deepinfer.engine.models.weights import init_dummy_weights
from torch import nn


def latent_cache_spec(cfg: DeepseekConfig, block_size: int, dtype: torch.dtype) -> MLACacheSpec:
    """The KV-cache layout of `cfg` (no model needed): one latent + rope key entry per token and layer."""
    mla = cfg.mla
    return MLACacheSpec(cfg.num_hidden_layers, mla.kv_lora_rank, mla.qk_rope_head_dim, block_size, dtype)


class DeepseekDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: DeepseekConfig, layer: int, rotary: DeepseekRotary, ops: Ops, dtype: torch.dtype,
                 device: torch.device | None) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, ops, dtype, device)
        self.self_attn = MLAttention(cfg.mla, hidden, cfg.softmax_scale, rotary, ops, dtype, device)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, ops, dtype, device)
        if cfg.moe.is_moe_layer(layer):
            self.mlp: nn.Module = DeepseekMoE(cfg.moe, hidden, cfg.mlp_bias, ops, dtype, device)
        else:
            self.mlp = GatedMLP(hidden, cfg.intermediate_size, cfg.mlp_bias, ops, dtype, device)


class DeepseekBody(nn.Module):
    """Embeddings, decoder layers and the final norm (transformers' `model.*`)."""

    def __init__(self, cfg: DeepseekConfig, rotary: DeepseekRotary, ops: Ops, dtype: torch.dtype,
                 device: torch.device | None) -> None:
        super().__init__()
        self.embed_tokens = embedding_table(cfg, dtype, device)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i, rotary, ops, dtype, device)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype, device)


class DeepseekForCausalLM(PagedCausalLM):
    """A DeepSeek-V2/V3 LM over a flattened variable-length batch and a paged latent KV cache."""

    def __init__(self, cfg: DeepseekConfig, ops: Ops, dtype: torch.dtype, device: torch.device | None = None,
                 max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.ops = ops
        self.dtype = dtype
        mla = cfg.mla
        self.rotary = DeepseekRotary(mla.qk_rope_head_dim, max_positions or cfg.max_position_embeddings,
                                     cfg.rope_theta, cfg.yarn, interleave=mla.rope_interleave,
                                     upcast=cfg.architecture == DEEPSEEK_V2, device=device)
        self.model = DeepseekBody(cfg, self.rotary, ops, dtype, device)
        self.lm_head = lm_head(cfg, self.model.embed_tokens, dtype, device)

    @property
    def max_positions(self) -> int:
        """Positions the rotary table covers: a token's position must be below this."""
        return self.rotary.max_positions

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> MLACacheSpec:
        """The latent cache layout: kv_lora_rank + qk_rope_head_dim values per token and layer."""
        return latent_cache_spec(self.config, block_size, dtype)

    def allocate_kv_cache(self, spec: MLACacheSpec, num_blocks: int, device: torch.device | str
                          ) -> list[torch.Tensor]:
        """One zeroed [num_blocks, block_size, R + P] tensor per layer, what `forward` takes as kv_caches."""
        return spec.allocate(num_blocks, device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in (per-expert or fused experts; MTP layers skipped)."""
        load_deepseek_weights(self, weights)

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Seeded random weights (benchmarks on real shapes without a checkpoint)."""
        init_dummy_weights(self, seed)
