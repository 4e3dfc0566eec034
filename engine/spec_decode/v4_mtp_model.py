"""DeepSeek-V4's multi-token-prediction (MTP) module as a draft model, and its loader.

DeepSeek's V4 checkpoints carry `num_nextn_predict_layers` modules as `mtp.K.*` (transformers ignores them:
`_keys_to_ignore_on_load_unexpected = mtp.*`). Per DeepSeek's reference `MTPBlock(Block)`, module K is a
full V4 decoder block (attention, hyper-connections `hc_attn_*` / `hc_ffn_*`, MoE `ffn.*`, named like a main
layer's) plus `enorm`, `hnorm`, `e_proj`, `h_proj` (both [hidden, hidden]), its own final `norm` and stream
collapse `hc_head_{fn,base,scale}`; it shares the target's embedding and LM head. For the target's final
`hc_mult` streams S_p at position p (before the target's own hc_head) and the token t_{p+1}:

    x = e_proj(enorm(embed(t_{p+1}))) (added to every stream) + h_proj(hnorm(S_p)) ;
    Y = block(x) (attention at position p over the draft layer's own window rows) ;
    logits = head(norm(hc_head(Y)))  -> a guess at t_{p+2}; chained drafts feed Y back in as S.

The block's attention kind is the checkpoint's `compress_ratios[num_hidden_layers]` (0, sliding only, in
the released configs); only a sliding-only MTP block is supported (a compressed one would need the
compressed pools addressed from the chained single-token steps). Its MoE is top-k routed (MTP sits past
the hash-routed first layers). Only the first MTP module is used. The draft's cache is one more sliding
layer in the target's layout (`V4CacheSpec.with_draft_layer`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from deepinfer.engine.layers.hyper_connections import HyperHead
from deepinfer.engine.layers.linear import Linear
from deepinfer.engine.layers.v4_norm import V4RMSNorm
from deepinfer.engine.models.deepseek_v4 import DeepseekV4ForCausalLM, V4DecoderLayer
from deepinfer.engine.models.deepseek_v4_config import MOE, SLIDING, DeepseekV4Config
from deepinfer.engine.models.deepseek_v4_weights import init_v4_dummy_weights, load_v4_weights
from deepinfer.kernels.metadata import AttentionMetadata
from torch import nn

# The MTP-only names, layer-relative, in DeepSeek's spelling -> this module's (`norm` would otherwise be read
# as the attention's `kv_norm` by the V4 renames; hc_head_* as the model-level head).
_MTP_RENAMES = (
    (re.compile(r"^norm\.weight$"), "mtp_norm.weight"),
    (re.compile(r"^hc_head_(fn|base|scale)$"), r"hc_head.hc_\1"),
)


def mtp_module_tensors(weights: dict[str, torch.Tensor], num_layers: int, k: int = 0
                       ) -> dict[str, torch.Tensor]:
    """MTP module k's tensors of `weights` (the target's `mtp_weights`), keyed by their layer-relative name
    (`mtp.k.X`, `model.mtp.k.X`, or `[model.]layers.{L+k}.X` -> X)."""
    pat = re.compile(rf"^(?:model\.)?(?:mtp\.{k}|layers\.{num_layers + k})\.(.+)$")
    return {m.group(1): t for name, t in weights.items() if (m := pat.match(name))}


def draft_config(cfg: DeepseekV4Config) -> DeepseekV4Config:
    """A one-layer config whose layer 0 is the MTP block (its attention kind, top-k MoE, no MTP)."""
    return dataclasses.replace(cfg, num_hidden_layers=1, layer_types=(cfg.mtp_layer_type,),
                               mlp_layer_types=(MOE,), num_mtp_layers=0)


class V4MTPLayer(V4DecoderLayer):
    """A V4 decoder block plus the MTP module's own parameters (names: DeepSeek's, see _MTP_RENAMES)."""

    def __init__(self, cfg: DeepseekV4Config, ops: Any, dtype: torch.dtype, device: torch.device | None
                 ) -> None:
        super().__init__(cfg, 0, ops, dtype, device)
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = V4RMSNorm(hidden, eps, ops, device)
        self.hnorm = V4RMSNorm(hidden, eps, ops, device)
        self.e_proj = Linear(hidden, hidden, False, ops, dtype, device)
        self.h_proj = Linear(hidden, hidden, False, ops, dtype, device)
        self.mtp_norm = V4RMSNorm(hidden, eps, ops, device)
        self.hc_head = HyperHead(cfg.hc_mult, hidden, cfg.hc_eps, eps, ops, device)


class V4MTPDraftModel(nn.Module):
    """The MTP block under `model.layers[0]` (so the V4 loader's names apply), with the calls the proposer
    makes: `target_features`, `forward`, `compute_logits`."""

    def __init__(self, target: DeepseekV4ForCausalLM) -> None:
        super().__init__()
        cfg = target.config
        if cfg.mtp_layer_type != SLIDING:
            raise ValueError(f"MTP block of attention kind {cfg.mtp_layer_type!r}: only sliding-only MTP "
                             "blocks (compress ratio 0, as released) are supported")
        self.config = draft_config(cfg)
        self.target_num_layers = cfg.num_hidden_layers
        self.ops = target.ops
        device = target.lm_head.weight.device
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([V4MTPLayer(self.config, target.ops, target.dtype, device)])
        self.mtp_weights: dict[str, torch.Tensor] = {}   # the V4 loader's place for MTP names (none here)
        # Shared, not owned: plain attributes, so neither the loader nor .parameters() sees them.
        self._target = [target]
        self._embed = target.model.embed_tokens.weight.detach()
        self._head = target.lm_head.weight.detach()
        self.main_rotary, self.compress_rotary = target.main_rotary, target.compress_rotary
        target.keep_streams = True

    @property
    def layer(self) -> V4MTPLayer:
        return self.model.layers[0]

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy an MTP module's layer-relative tensors in (ValueError naming what is missing/misshapen)."""
        load_v4_weights(self, _as_layer0(tensors))

    def init_dummy_weights(self, seed: int = 0) -> None:
        init_v4_dummy_weights(self, seed)

    def target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the draft reads from the target's step: its final streams [T, hc_mult, H], not `hidden`."""
        streams = self._target[0].last_streams
        if streams is None or streams.shape[0] != hidden.shape[0]:
            raise RuntimeError("the V4 target did not keep this step's streams (keep_streams is off?)")
        return streams

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, prev: torch.Tensor,
                meta: AttentionMetadata, cache: Any) -> torch.Tensor:
        """Tokens t_{p+1} [T], positions p [T], streams S_p [T, N, H] -> the block's streams Y [T, N, H].

        The layer's window rows are written at meta.slot_mapping (the slots of positions p) first."""
        layer = self.layer
        t, n, h = prev.shape
        emb = layer.enorm(F.embedding(input_ids, self._embed))
        streams = layer.h_proj(layer.hnorm(prev.to(emb.dtype)).reshape(t * n, h)).view(t, n, h)
        streams = streams + layer.e_proj(emb).unsqueeze(1)
        rotary = self.main_rotary if layer.uses_main_rope else self.compress_rotary
        return layer(streams, input_ids, positions, rotary(positions, emb.dtype), self.compress_rotary,
                     meta, cache)

    def compute_logits(self, streams: torch.Tensor) -> torch.Tensor:
        """Y [S, N, H] -> float32 logits [S, vocab] through the module's hc_head, norm and the shared head."""
        layer = self.layer
        return self.ops.linear(layer.mtp_norm(layer.hc_head(streams)), self._head).to(torch.float32)


def _as_layer0(tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    for rel, t in tensors.items():
        for pattern, repl in _MTP_RENAMES:
            rel = pattern.sub(repl, rel)
        yield f"model.layers.0.{rel}", t


class V4MTPLoader:
    """MTPLoader's counterpart for V4: the target's loader already keeps the MTP tensors (`mtp_weights`), so
    `collect` passes the stream through and `build` reads them from the target."""

    def __init__(self, cfg: Any, model: DeepseekV4ForCausalLM) -> None:
        self.cfg = cfg
        self.model = model

    def collect(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        return weights

    def build(self, dummy_seed: int | None = None, quant_plan: Any = None) -> V4MTPDraftModel | None:
        """The loaded draft (or seeded random weights with `dummy_seed`); None, with a warning, when the
        checkpoint's first MTP module is absent or incomplete."""
        from deepinfer.engine.spec_decode.setup import _off

        target = self.model
        try:
            draft = V4MTPDraftModel(target).eval()
        except ValueError as e:
            _off(str(e))
            return None
        if dummy_seed is not None:
            draft.init_dummy_weights(dummy_seed)
            return draft
        tensors = mtp_module_tensors(target.mtp_weights, target.config.num_hidden_layers)
        if not tensors:
            _off("the checkpoint holds no tensors of its MTP module (mtp.0.*)")
            target.keep_streams = False
            return None
        try:
            draft.load_weights(tensors)
        except ValueError as e:
            _off(f"its MTP layer does not load ({e})")
            target.keep_streams = False
            return None
        return draft
