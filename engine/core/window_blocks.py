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
Prefix caching (`enable_prefix_caching`) shares, per layer type, what a hit can restore exactly:
- window blocks: registered by content hash once full and computed, as for any model; a block released
  behind the span keeps its hash in the evictable free cache, so later requests can still hit it;
- aux blocks: entry indices follow their closing token (engine/layers/v4_cache.py), so aux block j depends
  only on the tokens before (j + 1) * bs * entry_rate and is registered under the hash of that prefix.
A hit at P tokens needs every aux block before P (P a multiple of bs * entry_rate: hits are that coarse) and
the window blocks over [P - keep_tokens, P); the blocks before are RELEASED stand-ins. Nothing is
recomputed: the shared rows and entries are the ones a run from 0 computes (a hitter never rewrites them:
it writes windows closing at or after P). Window blocks recomputed by a bounded replay are never registered
(their first rows are exact only for the later layers' needs). Window blocks per sequence stay bounded.

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
    """BlockManager over the window pool plus a pool of `num_aux_blocks` aux blocks (module docstring)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_aux_blocks: int,
        keep_tokens: int,
        entry_rate: int,
        replay_span: int,
        enable_prefix_caching: bool = False,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        if min(keep_tokens, entry_rate, replay_span) < 0:
            raise ValueError(
                f"keep_tokens={keep_tokens}, entry_rate={entry_rate}, replay_span={replay_span}: must be >= 0"
            )
        self.num_aux_blocks, self.keep_tokens, self.entry_rate = num_aux_blocks, keep_tokens, entry_rate
        self.replay_span = replay_span
        # The aux pool's refcounts, hashes and free lists (a plain BlockManager used as a pool).
        self._aux = BlockManager(num_aux_blocks, block_size, enable_prefix_caching)
        self._aux_hashed: dict[int, int] = {}  # seq_id -> leading aux blocks mark_computed has registered
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
        """A preempted sequence: RELEASED stand-ins for the blocks before its replay. Otherwise, with prefix
        caching, the longest exact hit (module docstring): stand-ins, then the cached window blocks."""
        replay = self._replay_from.get(seq.seq_id)
        if replay is not None or not self.enable_prefix_caching:
            return [RELEASED] * ((replay or 0) // self.block_size)
        bs, rate = self.block_size, self.entry_rate
        step = rate or 1  # window blocks per aux block
        max_blocks = (seq.num_tokens - 1) // bs
        hashes = self.block_hashes(seq, max_blocks)
        best: list[int] = []
        k = 0
        while k + step <= max_blocks:
            if rate and hashes[k + step - 1] not in self._aux._by_hash:
                break
            k += step
            lo = max(0, k * bs - self.keep_tokens) // bs
            window = [self._by_hash.get(h) for h in hashes[lo:k]]
            if all(b is not None for b in window):
                best = [RELEASED] * lo + window
        return best

    def _is_hit(self, seq: Sequence, cached_blocks: list[int]) -> bool:
        return bool(cached_blocks) and seq.seq_id not in self._replay_from

    def _aux_hits(self, seq: Sequence, num_window_blocks: int) -> list[int]:
        """The cached aux blocks before a hit at `num_window_blocks` blocks (match_prefix found them)."""
        if not self.entry_rate:
            return []
        hashes = self.block_hashes(seq, num_window_blocks)
        rate = self.entry_rate
        return [self._aux._by_hash[hashes[(j + 1) * rate - 1]] for j in range(num_window_blocks // rate)]

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int]) -> bool:
        hit = self._is_hit(seq, cached_blocks)
        if hit and not self.enable_prefix_caching:
            raise ValueError("WindowedBlockManager has prefix caching off: only replay stand-ins are given")
        k = len(cached_blocks)
        total = k * self.block_size + num_new_tokens
        if hit:
            aux_hits = self._aux_hits(seq, k)
            revived = sum(1 for b in cached_blocks if b != RELEASED and self._ref[b] == 0)
            aux_revived = sum(1 for b in aux_hits if self._aux._ref[b] == 0)
            aux = self._aux_need(seq, total, len(aux_hits))
            return (cdiv(total, self.block_size) - k <= self.num_free_blocks - revived
                    and aux <= self._aux.num_free_blocks - aux_revived)
        aux = self._aux_need(seq, total, None if k else 0)  # from scratch, kept entries are dropped
        return cdiv(total, self.block_size) - k <= self.num_free_blocks and aux <= self._aux.num_free_blocks

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        start = seq.num_computed_tokens
        need = self._num_new_blocks(len(seq.block_table), start + num_new_tokens)
        return need <= self.num_free_blocks + len(self._releasable(seq, start)) and self._aux_need(
            seq, start + num_new_tokens
        ) <= self._aux.num_free_blocks

    # ---- mutations -----------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int]) -> int:
        """Admit `seq` from position len(cached_blocks) * block_size (0, its replay start, or a prefix hit).
        Returns the cached tokens: those of a hit; 0 for a replay (its positions are recomputed)."""
        if seq.block_table:
            raise RuntimeError(f"seq {seq.seq_id} already holds blocks {seq.block_table}")
        if not self.can_allocate(seq, num_new_tokens, cached_blocks):
            raise RuntimeError(f"seq {seq.seq_id}: not enough free blocks for {num_new_tokens} tokens")
        hit = self._is_hit(seq, cached_blocks)
        replay_kept = 0 if hit else seq.aux_valid_tokens
        self._replay_from.pop(seq.seq_id, None)
        if not cached_blocks or hit:  # from scratch (e.g. prompt logprobs asked for): kept entries go too
            self._free_aux(seq)
        start = len(cached_blocks) * self.block_size
        if hit:
            for b in cached_blocks:
                if b != RELEASED:
                    self._revive(self, b)
            aux_hits = self._aux_hits(seq, len(cached_blocks))
            seq.aux_block_table = [self._revive(self._aux, b) for b in aux_hits]
        seq.block_table = list(cached_blocks)
        seq.num_cached_tokens = start if hit else 0
        seq.num_computed_tokens = start
        # A replay's first window rows are exact only for what later layers read: never register them.
        self._num_hashed[seq.seq_id] = len(cached_blocks) if hit else cdiv(replay_kept, self.block_size)
        self._aux_hashed[seq.seq_id] = len(seq.aux_block_table) if hit else 0
        self._grow(seq, start + num_new_tokens)
        self._grow_aux(seq, start + num_new_tokens)
        return seq.num_cached_tokens

    @staticmethod
    def _revive(pool: BlockManager, block: int) -> int:
        if pool._ref[block] == 0:
            del pool._free_cached[block]
        pool._ref[block] += 1
        return block

    def mark_computed(self, seq: Sequence) -> None:
        """Register the window blocks and aux blocks of `seq` that became full and computed."""
        if not self.enable_prefix_caching:
            return
        done = self._num_hashed.get(seq.seq_id)
        if done is None:
            raise RuntimeError(f"seq {seq.seq_id} holds no blocks")
        bs, n = self.block_size, seq.num_computed_tokens
        full = min(n // bs, len(seq.block_table))
        if full > done:
            hashes = self.block_hashes(seq, full)
            for i in range(done, full):
                _register(self, seq.block_table[i], hashes[i])
            self._num_hashed[seq.seq_id] = full
        rate = self.entry_rate
        aux_done = self._aux_hashed.get(seq.seq_id, 0)
        aux_full = min(n // (bs * rate), len(seq.aux_block_table)) if rate else 0
        if aux_full > aux_done:
            hashes = self.block_hashes(seq, aux_full * rate)
            for j in range(aux_done, aux_full):
                _register(self._aux, seq.aux_block_table[j], hashes[(j + 1) * rate - 1])
            self._aux_hashed[seq.seq_id] = aux_full

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        if not self.can_append(seq, num_new_tokens):
            return False
        start = seq.num_computed_tokens
        released = self._releasable(seq, start)
        if self.enable_prefix_caching:
            self._register_before_release(seq, released)
        for j in released:
            self._release(seq.block_table[j])
            seq.block_table[j] = RELEASED
        self._grow(seq, start + num_new_tokens)
        self._grow_aux(seq, start + num_new_tokens)
        return True

    def _register_before_release(self, seq: Sequence, released: list[int]) -> None:
        """Register blocks about to be released that mark_computed has not reached yet: with overlapped
        scheduling the next step is scheduled (and releases) before the last one's tokens are marked.
        Their tokens are resolved (they end keep_tokens before the computed ones, the pending token is the
        last); their rows are written by steps that run before any reader's."""
        done = self._num_hashed.get(seq.seq_id, 0)
        last = seq.num_tokens - (1 if seq.has_pending_token else 0)
        todo = [j for j in released if j >= done and (j + 1) * self.block_size <= last]
        if todo:
            hashes = self.block_hashes(seq, todo[-1] + 1)
            for j in todo:
                _register(self, seq.block_table[j], hashes[j])

    def free(self, seq: Sequence) -> None:
        self._free_window(seq)
        self._free_aux(seq)
        self._replay_from.pop(seq.seq_id, None)
        self._aux_hashed.pop(seq.seq_id, None)

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
        for b in reversed(seq.aux_block_table):
            _release(self._aux, b)
        seq.aux_block_table = []
        seq.aux_valid_tokens = 0

    def _release(self, block: int) -> None:
        _release(self, block)

    def _grow_aux(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self._aux_need(seq, num_tokens)):
            seq.aux_block_table.append(self._aux._take_free_block())

    def check_invariants(self) -> None:
        super().check_invariants()
        self._aux.check_invariants()


def _release(pool: BlockManager, block: int) -> None:
    """Drop one reference; at 0 a registered block stays cached (evictable), others become plain free."""
    pool._ref[block] -= 1
    if pool._ref[block] < 0:
        raise RuntimeError(f"block {block} refcount went negative")
    if pool._ref[block] == 0:
        if pool._hash[block] is not None:
            pool._free_cached[block] = None
        else:
            pool._free_plain.append(block)


def _register(pool: BlockManager, block: int, h: bytes) -> None:
    """Make `block` findable by its content hash (unless that content is cached already, or it is
    a RELEASED stand-in)."""
    if block != RELEASED and h not in pool._by_hash and pool._hash[block] is None:
        pool._hash[block] = h
        pool._by_hash[h] = block


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
            enable_prefix_caching,
        )
    return BlockManager(num_blocks, block_size, enable_prefix_caching)
