"""DeepSeek-V4's KV-cache layouts: what each layer keeps per token and per compressed entry, and where.

Per token and layer (the "window" part, offsets in `V4EntryLayout`):
- every layer: the sliding-window branch's shared key = value (`head_dim`, normed and rotated);
- CSA / HCA layers: the compressor's projections of the token (kv and gate; two series for CSA's
  overlapping windows, one for HCA) and, CSA only, the same for the Lightning Indexer at `index_head_dim`.
Per compressed entry (one per `rate` tokens): the entry (`head_dim`) and, CSA, the indexer's key.

Two layouts (the model picks one, `V4CacheSpec.bounded`):
- full: one tensor per layer [blocks, block_size, window + compressed width]; entry w sits in the row of
  the token that closes its window, (w + 1) * rate - 1. Every row depends only on the tokens up to it, so
  block tables, prefix caching and preemption work as for any model. Memory grows with every token.
- bounded: per layer a window tensor [blocks, block_size, window width] whose blocks a sequence holds only
  while they overlap the last `keep_tokens` positions (engine/core/window_blocks.py frees the rest), and a
  compressed tensor [aux_blocks, block_size, compressed width] in a second pool, addressed through the
  sequence's aux block table by the index of the entry's closing token at the finest rate `entry_rate`:
  entry w of rate r sits at (w + 1) * r / entry_rate - 1 (HCA's rows at other indices stay unused: 1/rate_hca
  of a row per token, a small price for one table). So aux block j depends only on the tokens before
  (j + 1) * block_size * entry_rate, and a full aux block can be shared by prefix caching like a token block.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from deepinfer.engine.models.deepseek_v4_config import CSA, SLIDING, DeepseekV4Config


@dataclass(frozen=True)
class V4EntryLayout:
    """Column offsets of one layer's window row and compressed row; a width of 0 means absent."""

    head_dim: int
    series: int  # compressor series per token: 2 (CSA, overlapping windows), 1 (HCA), 0 (sliding)
    index_head_dim: int  # 0 unless the layer has a Lightning Indexer (CSA)

    @property
    def swa(self) -> slice:
        return slice(0, self.head_dim)

    @property
    def raw_kv(self) -> slice:
        a = self.head_dim
        return slice(a, a + self.series * self.head_dim)

    @property
    def raw_gate(self) -> slice:
        a = self.raw_kv.stop
        return slice(a, a + self.series * self.head_dim)

    @property
    def idx_raw_kv(self) -> slice:
        a = self.raw_gate.stop
        return slice(a, a + 2 * self.index_head_dim)

    @property
    def idx_raw_gate(self) -> slice:
        a = self.idx_raw_kv.stop
        return slice(a, a + 2 * self.index_head_dim)

    @property
    def window_width(self) -> int:
        return self.idx_raw_gate.stop

    # Offsets inside the compressed row.
    @property
    def compressed(self) -> slice:
        return slice(0, self.head_dim if self.series else 0)

    @property
    def idx_compressed(self) -> slice:
        a = self.compressed.stop
        return slice(a, a + self.index_head_dim)

    @property
    def compressed_width(self) -> int:
        return self.idx_compressed.stop


def entry_layout(cfg: DeepseekV4Config, layer: int) -> V4EntryLayout:
    kind = cfg.layer_types[layer]
    series = 0 if kind == SLIDING else (2 if kind == CSA else 1)
    return V4EntryLayout(cfg.head_dim, series, cfg.index_head_dim if kind == CSA else 0)


def keep_tokens(cfg: DeepseekV4Config) -> int:
    """Positions before the next token that a later step still reads from the window part: the window's
    earlier keys, and the tokens of a compressor window not yet closed (CSA's two overlapping windows)."""
    need = cfg.window - 1
    for kind in set(cfg.layer_types) - {SLIDING}:
        need = max(need, (2 if kind == CSA else 1) * cfg.rate(kind) - 1)
    return need


def entry_rate(cfg: DeepseekV4Config) -> int:
    """Tokens per compressed-entry index (the finest compression rate in use; 0 without compressed layers)."""
    rates = [cfg.rate(k) for k in set(cfg.layer_types) - {SLIDING}]
    return min(rates) if rates else 0


@dataclass(frozen=True)
class V4CacheSpec:
    """Per-layer row widths of a layout; what the engine's sizing reads is `bytes_per_block`.

    Full layout: `window_dims` hold window + compressed widths and there is no aux pool. Bounded layout:
    a "block" as sized here is one window block plus `aux_per_block` compressed blocks, the mix a sequence
    of `max_model_len` tokens needs, so the planner's block count gives the window pool and
    `aux_blocks(n)` the compressed pool.
    """

    window_dims: tuple[int, ...]
    compressed_dims: tuple[int, ...]
    block_size: int
    dtype: torch.dtype
    bounded: bool = False
    keep_tokens: int = 0
    entry_rate: int = 0
    aux_per_block: float = 0.0
    replay_span: int = 0  # tokens a preempted sequence recomputes (core/window_blocks.py)
    sliding_width: int = 0  # row width of a sliding-only layer (what an MTP draft layer adds)

    @property
    def _elem(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """Full layout: bytes per token over all layers. Bounded: those of the window part only."""
        return sum(self.window_dims) * self._elem

    @property
    def aux_bytes_per_block(self) -> int:
        return self.block_size * sum(self.compressed_dims) * self._elem

    @property
    def bytes_per_block(self) -> int:
        own = self.block_size * self.bytes_per_token
        return own + math.ceil(self.aux_per_block * self.aux_bytes_per_block) if self.bounded else own

    def aux_blocks(self, num_blocks: int) -> int:
        return math.ceil(num_blocks * self.aux_per_block) if self.bounded else 0

    def window_blocks_per_seq(self) -> int:
        """The most window blocks one decoding sequence holds: its kept span and the token being computed."""
        return -(-(self.keep_tokens + 1) // self.block_size) + 1

    def bytes_per_seq(self, num_tokens: int) -> int:
        """KV bytes a sequence of `num_tokens` holds while decoding (at its largest)."""
        blocks = -(-num_tokens // self.block_size)
        if not self.bounded:
            return blocks * self.block_size * self.bytes_per_token
        window = min(blocks, self.window_blocks_per_seq()) * self.block_size * self.bytes_per_token
        entries = num_tokens // self.entry_rate if self.entry_rate else 0
        return window + -(-entries // self.block_size) * self.aux_bytes_per_block

    def with_draft_layer(self) -> V4CacheSpec:
        """This layout plus one sliding-only layer last (the MTP draft's, engine/spec_decode/): same blocks,
        slots and tables. Bounded: a replay must also make the draft layer's window exact, `keep_tokens`
        more positions (its rows read the target's last streams, exact only `num_layers * keep` in)."""
        return dataclasses.replace(
            self,
            window_dims=self.window_dims + (self.sliding_width,),
            compressed_dims=self.compressed_dims + (0,),
            replay_span=self.replay_span + self.keep_tokens if self.bounded else 0,
        )

    def allocate(self, num_blocks: int, device: torch.device | str) -> list:
        """Zero-filled caches: per layer a tensor (full) or a (window, compressed) pair (bounded)."""
        bs, n_aux = self.block_size, self.aux_blocks(num_blocks)
        if not self.bounded:
            return [
                torch.zeros((num_blocks, bs, d), dtype=self.dtype, device=device) for d in self.window_dims
            ]
        return [
            (
                torch.zeros((num_blocks, bs, w), dtype=self.dtype, device=device),
                torch.zeros((max(n_aux, 1), bs, c), dtype=self.dtype, device=device),
            )
            for w, c in zip(self.window_dims, self.compressed_dims)
        ]


def v4_cache_spec(
    cfg: DeepseekV4Config,
    block_size: int,
    dtype: torch.dtype,
    bounded: bool = False,
    max_model_len: int | None = None,
) -> V4CacheSpec:
    """The full layout, or the bounded one sized for sequences of `max_model_len` tokens."""
    layouts = [entry_layout(cfg, i) for i in range(cfg.num_hidden_layers)]
    sliding = V4EntryLayout(cfg.head_dim, 0, 0).window_width
    if not bounded:
        return V4CacheSpec(
            tuple(x.window_width + x.compressed_width for x in layouts),
            tuple(0 for _ in layouts),
            block_size,
            dtype,
            sliding_width=sliding,
        )
    keep, rate = keep_tokens(cfg), entry_rate(cfg)
    odd = sorted(r for k, r in cfg.compress_rates if k in cfg.layer_types and r % rate)
    if odd:
        raise ValueError(f"config.json: compression rates {odd} are not multiples of the finest ({rate}), "
                         "which the bounded cache indexes its compressed entries by")
    spec = V4CacheSpec(
        tuple(x.window_width for x in layouts),
        tuple(x.compressed_width for x in layouts),
        block_size,
        dtype,
        True,
        keep,
        rate,
        sliding_width=sliding,
    )
    length = max_model_len or cfg.max_position_embeddings
    entries = length // rate if rate else 0
    ratio = -(-entries // block_size) / spec.window_blocks_per_seq()
    # Tokens a preempted sequence recomputes: each layer's rows need keep_tokens earlier inputs exact.
    replay = cfg.num_hidden_layers * keep + 1
    return dataclasses.replace(spec, aux_per_block=ratio, replay_span=replay)
