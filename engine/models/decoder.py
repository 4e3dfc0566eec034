"""The decoder-only transformer shared by Llama, Mistral, Qwen2 and Qwen3 (pre-norm, RoPE, GQA, SwiGLU).

The architectures differ only in small switches (`ArchSpec`): q/k/v bias, per-head q/k RMSNorm, RoPE
scaling, tied embeddings. Parameters are named after Hugging Face's, with q/k/v merged into `qkv_proj`
and gate/up into `gate_up_proj` (one matmul each instead of three / two).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from deepinfer.engine.layers.attention import PagedSelfAttention
from deepinfer.engine.layers.mlp import GatedMLP
from deepinfer.engine.layers.norm import RMSNorm
from deepinfer.engine.layers.ops import Ops
from deepinfer.engine.layers.rotary import RotaryEmbedding
from deepinfer.engine.models.config import ModelConfig
from deepinfer.engine.models.stack import PagedCausalLM, PreNormDecoderLayer, embedding_table, lm_head
from deepinfer.engine.models.weights import init_dummy_weights, load_hf_weights
from deepinfer.kernels.metadata import AttentionMetadata
from torch import nn


@dataclass(frozen=True)
class ArchSpec:
    """What distinguishes one supported architecture from another."""

    qk_norm: bool = False         # Qwen3: RMSNorm over head_dim on q and k before RoPE


class DecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: ModelConfig, spec: ArchSpec, ops: Ops, dtype: torch.dtype,
                 device: torch.device | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype, device)
        self.self_attn = PagedSelfAttention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            qkv_bias=cfg.attention_bias, o_bias=cfg.o_proj_bias, qk_norm=spec.qk_norm,
            rms_norm_eps=cfg.rms_norm_eps, ops=ops, dtype=dtype, device=device,
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype, device)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, ops, dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        """PreNormDecoderLayer's step, where each norm hands an FP8 qkv_proj / gate_up_proj its output
        already quantized, per row or per K-group as the layer takes it (one kernel on CUDA, the same bits
        as quantizing in the linear), and o_proj and down_proj hand theirs to the next norm as
        `Ops.linear_into_norm` gives it (the returned x is such a value: only a norm reads it)."""
        qkv, gate_up = self.self_attn.qkv_proj, self.mlp.gate_up_proj
        h, residual = self.input_layernorm.forward_residual(x, residual, qkv.takes_quantized_rows,
                                                            qkv.quant_group)
        h = self.self_attn(h, rope, meta, kv_cache, into_norm=True)
        h, residual = self.post_attention_layernorm.forward_residual(
            h, residual, gate_up.takes_quantized_rows, gate_up.quant_group)
        return self.mlp(h, into_norm=True), residual


class DecoderBody(nn.Module):
    """Embeddings, decoder layers and the final norm (HF's `model.*`)."""

    def __init__(self, cfg: ModelConfig, spec: ArchSpec, ops: Ops, dtype: torch.dtype,
                 device: torch.device | None) -> None:
        super().__init__()
        self.embed_tokens = embedding_table(cfg, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec, ops, dtype, device)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype, device)


class CausalLM(PagedCausalLM):
    """A decoder-only causal LM running a flattened variable-length batch over a paged KV cache."""

    def __init__(self, cfg: ModelConfig, spec: ArchSpec, ops: Ops, dtype: torch.dtype,
                 device: torch.device | None = None, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.ops = ops
        self.dtype = dtype
        self.model = DecoderBody(cfg, spec, ops, dtype, device)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings,
                                      cfg.rope_theta, cfg.rope_scaling, device)
        self.lm_head = lm_head(cfg, self.model.embed_tokens, dtype, device)

    @property
    def max_positions(self) -> int:
        """Positions the rotary table covers: a token's position must be below this."""
        return int(self.rotary.cos_cache.shape[0])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the model (any device/dtype; converted on copy).

        ValueError on a tensor the model has no place for, a shape mismatch, or missing weights.
        """
        load_hf_weights(self, weights)

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Fill every parameter with seeded random values (benchmarks on real shapes without a checkpoint)."""
        init_dummy_weights(self, seed)
