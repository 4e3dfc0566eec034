"""DeepSeek-V3's multi-token-prediction (MTP) module as a draft model.

The checkpoint stores it as layer `num_hidden_layers` (`model.layers.{L}.*`): `enorm`, `hnorm`, `eh_proj`,
one decoder block named like the other layers (MLA + MoE, or a dense MLP below first_k_dense_replace),
`shared_head.norm`, `shared_head.head`, and usually a copy of the embedding (`embed_tokens`). For the
target's hidden state h_p at position p (final-normed, what the target's LM head reads) and the token
t_{p+1} that follows it:

    x = eh_proj([enorm(embed(t_{p+1})) ; hnorm(h_p)]) ; y = block(x) (attention at position p, over the
    MTP layer's own latent cache) ; logits = shared_head.head(shared_head.norm(y))  -> a guess at t_{p+2}.

As in vLLM's reader of these checkpoints, the embedding is zeroed at position 0. Chained drafts feed y back
in as h. When the layer carries no embedding or head copy, the target's are shared (the MTP module shares
them by design). Only the first MTP layer is used when a checkpoint has several.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from deepinfer.engine.layers.linear import Linear, empty_param
from deepinfer.engine.layers.norm import RMSNorm
from deepinfer.engine.models.deepseek import DeepseekDecoderLayer, DeepseekForCausalLM
from deepinfer.engine.models.deepseek_weights import load_deepseek_weights
from deepinfer.engine.models.weights import init_dummy_weights
from deepinfer.kernels.metadata import AttentionMetadata
from torch import nn

_OWN_EMBED = "embed_tokens.weight"
_OWN_HEAD = "shared_head.head.weight"


def mtp_layer_index(name: str, first: int) -> int | None:
    """The layer index of checkpoint tensor `name` when it belongs to a layer >= `first` (an MTP layer)."""
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m and int(m.group(1)) >= first else None


class MTPLayer(DeepseekDecoderLayer):
    """The decoder block's modules (input_layernorm, self_attn, post_attention_layernorm, mlp) plus MTP's own,
    so that parameter names below `model.layers.{L}.` are exactly the checkpoint's."""

    def __init__(self, target: DeepseekForCausalLM, own_embed: bool, own_head: bool) -> None:
        cfg, ops, dtype = target.config, target.ops, target.dtype
        device = target.lm_head.weight.device
        super().__init__(cfg, cfg.num_hidden_layers, target.rotary, ops, dtype, device)
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps, ops, dtype, device)
        self.hnorm = RMSNorm(hidden, eps, ops, dtype, device)
        self.eh_proj = Linear(2 * hidden, hidden, False, ops, dtype, device)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, eps, ops, dtype, device)
        if own_head:
            self.shared_head.head = nn.Module()
            self.shared_head.head.weight = empty_param(cfg.vocab_size, hidden, dtype=dtype, device=device)
        if own_embed:
            self.embed_tokens = nn.Module()
            self.embed_tokens.weight = empty_param(cfg.vocab_size, hidden, dtype=dtype, device=device)


class MTPDraftModel(nn.Module):
    """The MTP layer under `model.layers[str(L)]`, with the loader and the two calls the proposer makes."""

    def __init__(self, target: DeepseekForCausalLM, own_embed: bool, own_head: bool) -> None:
        super().__init__()
        cfg = target.config
        # The loader skips layers >= num_hidden_layers when the config counts MTP layers; here they are ours.
        self.config = dataclasses.replace(cfg, num_mtp_layers=0)
        self.layer_index = self.target_num_layers = cfg.num_hidden_layers
        self.ops = target.ops
        self.rotary = target.rotary
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(self.layer_index): MTPLayer(target, own_embed, own_head)})
        layer = self.layer
        # Shared with the target unless the checkpoint gives the layer its own copy; detached views (plain
        # attributes, not parameters, so the loader does not ask for them; in-place loads show through).
        self._embed = (layer.embed_tokens.weight if own_embed else target.model.embed_tokens.weight).detach()
        self._head = (layer.shared_head.head.weight if own_head else target.lm_head.weight).detach()

    @property
    def layer(self) -> MTPLayer:
        return self.model.layers[str(self.layer_index)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the MTP layer's checkpoint tensors in (ValueError naming what is missing or misshapen)."""
        load_deepseek_weights(self, weights)

    def init_dummy_weights(self, seed: int = 0) -> None:
        init_dummy_weights(self, seed)

    def target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the draft reads from the target's step: its final-normed hidden states as they are."""
        return hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, prev_hidden: torch.Tensor,
                meta: AttentionMetadata, cache: torch.Tensor) -> torch.Tensor:
        """Tokens t_{p+1} [T], positions p [T], hidden states h_p [T, H] -> the block's output y [T, H].

        The layer's latents are written at meta.slot_mapping (the slots of positions p) before attention."""
        layer = self.layer
        emb = F.embedding(input_ids, self._embed)
        emb = torch.where((positions == 0).unsqueeze(1), torch.zeros_like(emb), emb)
        x = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(prev_hidden.to(emb.dtype))], dim=-1))
        rope = self.rotary(positions, x.dtype)
        h, residual = layer(x, None, rope, meta, cache)
        return h + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """y [S, H] -> float32 logits [S, vocab] through shared_head."""
        return self.ops.linear(self.layer.shared_head.norm(hidden), self._head).to(torch.float32)
