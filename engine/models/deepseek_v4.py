"""DeepSeek-V4 causal LM (transformers' DeepseekV4ForCausalLM) over a flattened batch and paged entries.

Each decoder layer keeps `hc_mult` residual streams (manifold-constrained hyper-connections,
engine/layers/hyper_connections.py) around a V4 attention block (engine/layers/v4_attention.py: sliding
window + CSA or HCA compressed branch per `layer_types`) and a MoE block (engine/layers/hash_moe.py:
hash-routed for `hash_moe` layers, top-k otherwise). The model chooses its own KV-cache layout
(`kv_cache_spec` / `allocate_kv_cache`, engine/layers/v4_cache.py): the bounded window + compressed pools
with or without prefix caching (`configure_kv_cache`, engine/core/window_blocks.py).
Its decode steps run eagerly, never as CUDA graphs (engine/runner/cuda_graphs.py `graphs_supported`): the
window and compressed-entry attention plans its steps on the host, which a captured graph would freeze.
MTP modules in the checkpoint are loaded and kept aside in `mtp_weights`; with MTP drafting on, the draft
(engine/spec_decode/v4_mtp_model.py) builds itself from them and sets `keep_streams`, so that `forward`
leaves the final `hc_mult` streams (what DeepSeek's MTP block reads, before `hc_head`) in `last_streams`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from deepinfer.engine.layers.hash_moe import V4MoE
from deepinfer.engine.layers.hyper_connections import HyperConnection, HyperHead, merge_streams
from deepinfer.engine.layers.ops import Ops
from deepinfer.engine.layers.v4_attention import V4Attention
from deepinfer.engine.layers.v4_cache import V4CacheSpec, v4_cache_spec
from deepinfer.engine.layers.v4_norm import V4RMSNorm
from deepinfer.engine.layers.v4_rope import V4Rotary
from deepinfer.engine.models.deepseek_v4_config import SLIDING, DeepseekV4Config
from deepinfer.engine.models.deepseek_v4_weights import init_v4_dummy_weights, load_v4_weights
from deepinfer.engine.models.stack import PagedCausalLM, embedding_table, lm_head
from deepinfer.kernels.metadata import AttentionMetadata
from torch import nn


class V4DecoderLayer(nn.Module):
    def __init__(
        self, cfg: DeepseekV4Config, layer: int, ops: Ops, dtype: torch.dtype, device: torch.device | None
    ) -> None:
        super().__init__()
        hc = (cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps, ops, device)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)
        self.input_layernorm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, device)
        self.post_attention_layernorm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, device)
        self.self_attn = V4Attention(cfg, layer, ops, dtype, device)
        self.mlp = V4MoE(cfg, layer, ops, dtype, device)
        self.uses_main_rope = cfg.layer_types[layer] == SLIDING

    def forward(
        self,
        streams: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        rotary: V4Rotary,
        meta: AttentionMetadata,
        cache: torch.Tensor,
    ) -> torch.Tensor:
        """streams [T, hc_mult, hidden] -> the same, after the attention and MoE blocks."""
        post, comb, collapsed = self.attn_hc(streams)
        out = self.self_attn(self.input_layernorm(collapsed), positions, rope, rotary, meta, cache)
        streams = merge_streams(streams, out, post, comb)
        post, comb, collapsed = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(collapsed), input_ids)
        return merge_streams(streams, out, post, comb)


class DeepseekV4Body(nn.Module):
    """Embeddings, decoder layers, the final stream collapse (`hc_head`) and norm (HF's `model.*`)."""

    def __init__(
        self, cfg: DeepseekV4Config, ops: Ops, dtype: torch.dtype, device: torch.device | None
    ) -> None:
        super().__init__()
        self.embed_tokens = embedding_table(cfg, dtype, device)
        self.layers = nn.ModuleList(
            V4DecoderLayer(cfg, i, ops, dtype, device) for i in range(cfg.num_hidden_layers)
        )
        self.hc_head = HyperHead(cfg.hc_mult, cfg.hidden_size, cfg.hc_eps, cfg.rms_norm_eps, ops, device)
        self.norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, device)


class DeepseekV4ForCausalLM(PagedCausalLM):
    """A DeepSeek-V4 LM; `forward` writes this step's token entries into the paged caches, then reads them."""

    def __init__(
        self,
        cfg: DeepseekV4Config,
        ops: Ops,
        dtype: torch.dtype,
        device: torch.device | None = None,
        max_positions: int | None = None,
    ) -> None:
        super().__init__()
        self.config, self.ops, self.dtype = cfg, ops, dtype
        self._max_positions = max_positions or cfg.max_position_embeddings
        self.main_rotary = V4Rotary(cfg.main_rope, ops.deterministic, device)
        self.compress_rotary = V4Rotary(cfg.compress_rope, ops.deterministic, device)
        self.model = DeepseekV4Body(cfg, ops, dtype, device)
        self.lm_head = lm_head(cfg, self.model.embed_tokens, dtype, device)
        self.mtp_weights: dict[str, torch.Tensor] = {}
        self._bounded, self._cache_len = False, max_positions
        self.keep_streams = False
        self.last_streams: torch.Tensor | None = None

    @property
    def max_positions(self) -> int:
        """Positions the model accepts (rope is computed per position, so this is the config's bound)."""
        return self._max_positions

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: list
    ) -> torch.Tensor:
        """input_ids, positions int64 [T] -> final-normed hidden states [T, hidden]."""
        layers = self.model.layers
        if len(kv_caches) != len(layers):
            raise ValueError(f"kv_caches has {len(kv_caches)} entries; the model has {len(layers)} layers")
        x = F.embedding(input_ids, self.model.embed_tokens.weight)
        streams = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        main = self.main_rotary(positions, x.dtype)
        compress = self.compress_rotary(positions, x.dtype)
        for layer, cache in zip(layers, kv_caches):
            rope = main if layer.uses_main_rope else compress
            streams = layer(streams, input_ids, positions, rope, self.compress_rotary, meta, cache)
        if self.keep_streams:  # the MTP draft's input, read right after this call (spec_decode/proposer.py)
            self.last_streams = streams
        return self.model.norm(self.model.hc_head(streams))

    def configure_kv_cache(self, enable_prefix_caching: bool, max_model_len: int | None = None) -> None:
        """Pick the cache layout before the engine sizes it (engine/layers/v4_cache.py): the bounded window
        + compressed pools, sized for sequences of `max_model_len` tokens, with or without prefix caching
        (core/window_blocks.py says what a hit shares). The full layout (every token's rows) stays for
        configs whose compression rates are not multiples of the finest one."""
        rates = [self.config.rate(k) for k in set(self.config.layer_types) - {SLIDING}]
        self._bounded = all(r % min(rates) == 0 for r in rates)
        self._cache_len = max_model_len

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> V4CacheSpec:
        """Per-layer rows: shared kv, plus compressor projections and entries on CSA/HCA layers."""
        return v4_cache_spec(self.config, block_size, dtype, self._bounded, self._cache_len)

    def allocate_kv_cache(
        self, spec: V4CacheSpec, num_blocks: int, device: torch.device | str
    ) -> list:
        """Per layer a tensor (full layout) or a (window, compressed) pair (bounded)."""
        return spec.allocate(num_blocks, device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in (transformers' names or DeepSeek's; MTP modules kept in mtp_weights)."""
        load_v4_weights(self, weights)

    def init_dummy_weights(self, seed: int = 0) -> None:
        """Seeded random weights and hash tables (benchmarks on real shapes without a checkpoint)."""
        init_v4_dummy_weights(self, seed)
