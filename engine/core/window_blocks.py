"""Block accounting for a model whose cache keeps a bounded window plus a compressed part (DeepSeek-V4).

A model declares this through its cache spec (`bounded`, `keep_tokens`, `entry_rate`, `replay_span`,
`aux_blocks(n)`; engine/layers/v4_cache.py). Two pools:
- window blocks, token-indexed as for any model (`seq.block_table[i]` holds positions [i*bs, (i+1)*bs)).
  Before a step computes tokens from position s, every block lying wholly below s - keep_tokens is given
  back and its table entry becomes RELEASED: later steps never read it. A decoding sequence therefore holds
  at most ceil((keep_tokens + 1) / block_size) + 1 window blocks, whatever its length (a prefill chunk of
  C tokens holds C more while it runs).
- aux blocks, indexed by compressed entry (entry e of the sequence lives in `seq.aux_block_table[e // bs]`),
  one entry per `entry_rate` tokens, kept for the sequence's life.
Prefix caching is off for this layout (released windows cannot be shared; the model's full layout, chosen
when prefix caching is on, shares everything instead).

Bounded replay: a preempted sequence that had computed n tokens gives back its window blocks but keeps its
aux blocks (`seq.aux_valid_tokens` = n: the model never rewrites those entries). On re-admission it
recomputes from a = n - replay_span (rounded down to a block; `match_prefix` reports the blocks before a
as RELEASED stand-ins), not from 0. Why that span suffices: a layer's window rows at position p depend on
the layer input of positions [p - keep_tokens, p], so with inputs exact from position E at layer l, they
are exact from E + keep_tokens at layer l + 1; from a, after num_layers layers, everything from
a + num_layers * keep_tokens on is exact, which covers the last sampled position and the window every
later step reads. `replay_span` = num_layers * keep_tokens + 1, independent of the sequence's length.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from deepinfer.engine.core.block_manager import BlockManager, cdiv
from deepinfer.engine.core.sequence import Sequence
from deepinfer.kernels.metadata import AttentionMetadata

RELEASED = -1


@dataclass
class AuxAttentionMetadata(AttentionMetadata):
    """AttentionMetadata plus each sequence's compressed-entry blocks, int32 [B, max_aux] padded with 0."""

    aux_block_tables: torch.Tensor | None = None
    # Per sequence: tokens whose compressed entries the aux pool already holds (the model skips them).
    aux_valid_tokens_cpu: list[int] | None = None


def with_aux_tables(meta: AttentionMetadata, seqs: list[Sequence], to_device: Any) -> AttentionMetadata:
    """`meta` extended with the sequences' aux block tables (unchanged when no sequence has any)."""
    width = max((len(s.aux_block_table) for s in seqs), default=0)
    if width == 0:
        return meta
    arr = np.zeros((len(seqs), width), dtype=np.int32)
    for b, s in enumerate(seqs):
        arr[b, : len(s.aux_block_table)] = s.aux_block_table
    return AuxAttentionMetadata(
        **vars(meta), aux_block_tables=to_device(arr), aux_valid_tokens_cpu=[s.aux_valid_tokens for s in seqs]
    )


class WindowedBlockManager(BlockManager):
    """BlockManager over the window pool (prefix caching off) plus a pool of `num_aux_blocks` aux blocks."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_aux_blocks: int,
        keep_tokens: int,
        entry_rate: int,
        replay_span: int,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)
        if min(keep_tokens, entry_rate, replay_span) < 0:
            raise ValueError(
                f"keep_tokens={keep_tokens}, entry_rate={entry_rate}, replay_span={replay_span}: must be >= 0"
            )
        self.num_aux_blocks, self.keep_tokens, self.entry_rate = num_aux_blocks, keep_tokens, entry_rate
        self.replay_span = replay_span
        self._aux_free: deque[int] = deque(range(num_aux_blocks))
        self._replay_from: dict[int, int] = {}  # seq_id -> block-aligned position its replay starts at

    # ---- queries -------------------------------------------------------------------------------
    @property
    def window_blocks_per_seq(self) -> int:
        return cdiv(self.keep_tokens + 1, self.block_size) + 1

    def token_capacity(self) -> int:
        """The longest sequence the two pools can hold on their own."""
        if self.num_blocks < self.window_blocks_per_seq:
            return self.num_blocks * self.block_size
        if not self.entry_rate:
            return 1 << 62
        return (self.num_aux_blocks * self.block_size + 1) * self.entry_rate - 1

    def window_blocks_held(self, seq: Sequence) -> int:
        return sum(1 for b in seq.block_table if b != RELEASED)

    def _aux_need(self, seq: Sequence, num_tokens_after: int, held: int | None = None) -> int:
        entries = num_tokens_after // self.entry_rate if self.entry_rate else 0
        have = len(seq.aux_block_table) if held is None else held
        return max(0, cdiv(entries, self.block_size) - have)

    def _releasable(self, seq: Sequence, next_position: int) -> list[int]:
        """Indices of held window blocks wholly below next_position - keep_tokens."""
        limit = (next_position - self.keep_tokens) // self.block_size
        return [j for j in range(min(limit, len(seq.block_table))) if seq.block_table[j] != RELEASED]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """No prefix cache; a preempted sequence gets RELEASED stand-ins for the blocks before its replay."""
        return [RELEASED] * (self._replay_from.get(seq.seq_id, 0) // self.block_size)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int]) -> bool:
        if any(b != RELEASED for b in cached_blocks):
            raise ValueError(
                "WindowedBlockManager has prefix caching off: only replay stand-ins may be given"
            )
        k = len(cached_blocks)
        total = k * self.block_size + num_new_tokens
        aux = self._aux_need(seq, total, None if k else 0)  # from scratch, kept entries are dropped
        return cdiv(total, self.block_size) - k <= self.num_free_blocks and aux <= len(self._aux_free)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        start = seq.num_computed_tokens
        need = self._num_new_blocks(len(seq.block_table), start + num_new_tokens)
        return need <= self.num_free_blocks + len(self._releasable(seq, start)) and self._aux_need(
            seq, start + num_new_tokens
        ) <= len(self._aux_free)

    # ---- mutations -----------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int]) -> int:
        """Admit `seq` from position len(cached_blocks) * block_size (0, or its replay start). Returns 0:
        replayed positions are recomputed, not prefix-cache hits."""
        if seq.block_table:
            raise RuntimeError(f"seq {seq.seq_id} already holds blocks {seq.block_table}")
        if not self.can_allocate(seq, num_new_tokens, cached_blocks):
            raise RuntimeError(f"seq {seq.seq_id}: not enough free blocks for {num_new_tokens} tokens")
        self._replay_from.pop(seq.seq_id, None)
        if not cached_blocks:  # from scratch (e.g. prompt logprobs asked for): kept entries go too
            self._free_aux(seq)
        start = len(cached_blocks) * self.block_size
        seq.block_table = list(cached_blocks)
        seq.num_cached_tokens = 0
        seq.num_computed_tokens = start
        self._grow(seq, start + num_new_tokens)
        self._grow_aux(seq, start + num_new_tokens)
        return 0

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        if not self.can_append(seq, num_new_tokens):
            return False
        start = seq.num_computed_tokens
        for j in self._releasable(seq, start):
            self._release(seq.block_table[j])
            seq.block_table[j] = RELEASED
        self._grow(seq, start + num_new_tokens)
        self._grow_aux(seq, start + num_new_tokens)
        return True

    def free(self, seq: Sequence) -> None:
        self._free_window(seq)
        self._free_aux(seq)
        self._replay_from.pop(seq.seq_id, None)

    def preempt(self, seq: Sequence) -> None:
        """Give back the window blocks, keep the compressed entries, remember where the replay starts."""
        n = seq.num_computed_tokens
        start = max(0, n - self.replay_span) // self.block_size * self.block_size
        self._free_window(seq)
        if start == 0:
            self._free_aux(seq)
            self._replay_from.pop(seq.seq_id, None)
        else:
            seq.aux_valid_tokens = max(seq.aux_valid_tokens, n)
            self._replay_from[seq.seq_id] = start

    def _free_window(self, seq: Sequence) -> None:
        for b in reversed(seq.block_table):
            if b != RELEASED:
                self._release(b)
        seq.block_table = []
        self._num_hashed.pop(seq.seq_id, None)

    def _free_aux(self, seq: Sequence) -> None:
        self._aux_free.extend(reversed(seq.aux_block_table))
        seq.aux_block_table = []
        seq.aux_valid_tokens = 0

    def _release(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] < 0:
            raise RuntimeError(f"block {block} refcount went negative")
        if self._ref[block] == 0:
            self._free_plain.append(block)

    def _grow_aux(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self._aux_need(seq, num_tokens)):
            seq.aux_block_table.append(self._aux_free.popleft())


def make_block_manager(
    spec: Any, num_blocks: int, block_size: int, enable_prefix_caching: bool
) -> BlockManager:
    """The block manager a cache layout needs: windowed when the model's spec says `bounded`."""
    if getattr(spec, "bounded", False):
        return WindowedBlockManager(
            num_blocks,
            block_size,
            spec.aux_blocks(num_blocks),
            spec.keep_tokens,
            spec.entry_rate,
            spec.replay_span,
        )
    return BlockManager(num_blocks, block_size, enable_prefix_caching)
