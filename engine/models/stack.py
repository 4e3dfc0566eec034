"""What every paged causal LM here shares: the layer loop over the paged caches and the logits head.

A model subclass provides `model.embed_tokens`, `model.layers` (each called as
`layer(x, residual, rope, meta, kv_cache) -> (x, residual)`), `model.norm` (with `forward_residual`),
`rotary(positions, dtype)`, `lm_head` and `ops`.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from deepinfer.engine.layers.linear import empty_param
from deepinfer.kernels.metadata import AttentionMetadata
from torch import nn


class VocabShape(Protocol):
    """The config fields the token tables need (every model config here has them)."""

    vocab_size: int
    hidden_size: int
    tie_word_embeddings: bool


def embedding_table(cfg: VocabShape, dtype: torch.dtype, device: torch.device | None) -> nn.Module:
    """`model.embed_tokens`: a module holding the uninitialised weight [vocab_size, hidden_size]."""
    table = nn.Module()
    table.weight = empty_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
    return table


def lm_head(cfg: VocabShape, embed_tokens: nn.Module, dtype: torch.dtype, device: torch.device | None
            ) -> nn.Module:
    """`lm_head`: the embedding table itself with tied word embeddings, else a table of its own."""
    return embed_tokens if cfg.tie_word_embeddings else embedding_table(cfg, dtype, device)


class PreNormDecoderLayer(nn.Module):
    """A pre-norm residual block: subclasses build `input_layernorm`, `self_attn`,
    `post_attention_layernorm` and `mlp`; the residual add is fused into each norm."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.forward_residual(x, residual)
        h = self.self_attn(h, rope, meta, kv_cache)
        h, residual = self.post_attention_layernorm.forward_residual(h, residual)
        return self.mlp(h), residual


class PagedCausalLM(nn.Module):
    """Base of the engine's models: `forward` over the paged KV caches, then `compute_logits`."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list) -> torch.Tensor:
        """input_ids, positions int64 [T] -> final-normed hidden states [T, hidden].

        kv_caches[i] is layer i's cache (its layout is the model's own); this step's keys/values (or
        latents) are written at `meta.slot_mapping` before attention reads them.
        """
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"kv_caches has {len(kv_caches)} entries; the model has "
                             f"{len(self.model.layers)} layers")
        x = F.embedding(input_ids, self.model.embed_tokens.weight)
        rope = self.rotary(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, rope, meta, kv_cache)
        x, _ = self.model.norm.forward_residual(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] (already final-normed by forward) -> float32 logits [S, vocab_size]."""
        return self.compute_logits_native(hidden).to(torch.float32)

    def compute_logits_native(self, hidden: torch.Tensor) -> torch.Tensor:
        """The same logits in the lm head's dtype (bf16 on the GPU). The engine's step samples from these:
        the sampler upcasts exactly where it needs float32, so the [S, vocab] float32 copy (~0.1 ms a decode
        step at a 152k vocabulary, 256 rows) is never made."""
        return self.ops.linear(hidden, self.lm_head.weight)
