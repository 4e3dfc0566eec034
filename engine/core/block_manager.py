"""Paged KV-cache block accounting with prefix caching (pure CPU bookkeeping, no tensors).

A sequence's KV lives in fixed-size blocks of `block_size` token slots; `seq.block_table[i]` holds
positions [i * block_size, (i + 1) * block_size). Blocks are reference-counted so that sequences
sharing a cached prefix share its blocks.

Prefix caching: a FULL, computed block is identified by a chained content hash,
``h_i = blake2b(h_{i-1} || little-endian int64 token ids of block i)`` (``h_{-1}`` is empty), so
the same tokens after a different prefix hash differently, and hashes are stable across processes.
Only full blocks are ever hashed or shared: a block still being written belongs to one sequence.

Free blocks live in exactly one of two structures:
  * ``_free_plain``: blocks holding no registered hash, handed out first (FIFO);
  * ``_free_cached``: blocks with refcount 0 that keep their hash, in LRU order (least recently
    freed first). They are evicted (hash dropped) only when no plain block is left, and revived
    (refcount 1, out of the LRU) when a new sequence hits their hash.
A block with refcount > 0 is never in a free structure and is never evicted.

Every operation is O(1) per block touched; nothing depends on wall time, randomness or dict order.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque

from deepinfer.engine.core.sequence import Sequence


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    """Content hash of one full block given the hash of the block before it (b"" for the first)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Allocates KV blocks to sequences; shares cached full prefix blocks between them.

    Lifecycle of one sequence (driven by the scheduler):
      1. admission: ``hits = match_prefix(seq)``; ``can_allocate(seq, n, hits)``;
         ``allocate(seq, n, hits)`` takes the hit blocks and room for ``n`` more tokens;
      2. each later step: ``can_append(seq, n)`` / ``append_slots(seq, n)`` before computing ``n`` tokens;
      3. after a step computed tokens: ``mark_computed(seq)`` registers newly full blocks' hashes;
      4. finish or preemption: ``free(seq)``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockManager num_blocks={num_blocks}: must be >= 1")
        if block_size < 1:
            raise ValueError(f"BlockManager block_size={block_size}: must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks   # registered content hash per block
        self._by_hash: dict[bytes, int] = {}
        self._free_plain: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        # seq_id -> number of leading blocks of its table already hashed/registered by mark_computed.
        self._num_hashed: dict[int, int] = {}

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any sequence (plain free + evictable cached)."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._free_cached)

    @property
    def usage(self) -> float:
        """Share of blocks referenced by sequences, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def token_capacity(self) -> int:
        """The longest sequence (in KV slots) the cache can hold on its own."""
        return self.num_blocks * self.block_size

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Chained hashes of the first `num_blocks` full blocks of seq.token_ids (memoized on seq)."""
        hashes: list[bytes] = seq.block_hashes
        bs = self.block_size
        if len(hashes) < num_blocks:
            if num_blocks * bs > seq.num_tokens:
                raise ValueError(f"seq {seq.seq_id}: block {num_blocks - 1} is not full")
            tokens = seq.token_ids
            for i in range(len(hashes), num_blocks):
                hashes.append(hash_block(hashes[i - 1] if i else b"", tokens[i * bs:(i + 1) * bs]))
        return hashes[:num_blocks]

    def num_registered_blocks(self, seq: Sequence) -> int:
        """Leading blocks of seq's table whose hashes mark_computed has registered (0 without blocks)."""
        return self._num_hashed.get(seq.seq_id, 0)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest cached prefix of seq.token_ids. Changes nothing.

        Hits are capped at ``(seq.num_tokens - 1) // block_size`` blocks: at least one token is always
        left to compute, so the step that finishes the prefill produces logits to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        bs = self.block_size
        hashes: list[bytes] = seq.block_hashes
        tokens: list[int] | None = None
        for i in range(max_blocks):
            if i == len(hashes):   # hash lazily: stop at the first miss without hashing the rest
                tokens = tokens if tokens is not None else seq.token_ids
                hashes.append(hash_block(hashes[i - 1] if i else b"", tokens[i * bs:(i + 1) * bs]))
            block = self._by_hash.get(hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits

    def _num_new_blocks(self, num_slots_have: int, num_tokens_after: int) -> int:
        return max(0, cdiv(num_tokens_after, self.block_size) - num_slots_have)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int]) -> bool:
        """Whether a waiting `seq` can be admitted reusing `cached_blocks` (from match_prefix) and
        computing `num_new_tokens` tokens after them."""
        total = len(cached_blocks) * self.block_size + num_new_tokens
        need = self._num_new_blocks(len(cached_blocks), total)
        revived = sum(1 for b in cached_blocks if self._ref[b] == 0)   # they leave the free pool
        return need <= self.num_free_blocks - revived

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether a running `seq` can get slots for `num_new_tokens` tokens after its computed ones."""
        need = self._num_new_blocks(len(seq.block_table), seq.num_computed_tokens + num_new_tokens)
        return need <= self.num_free_blocks

    # ---- mutations -----------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int]) -> int:
        """Admit `seq`: take `cached_blocks` (a match_prefix result from this same step) and fresh
        blocks for `num_new_tokens` more tokens. Sets seq.block_table, seq.num_cached_tokens and
        seq.num_computed_tokens (= cached tokens) and returns the number of cached tokens.

        Raises RuntimeError when the blocks do not fit (call can_allocate first)."""
        if seq.block_table:
            raise RuntimeError(f"seq {seq.seq_id} already holds blocks {seq.block_table}")
        if not self.can_allocate(seq, num_new_tokens, cached_blocks):
            raise RuntimeError(f"seq {seq.seq_id}: not enough free blocks for {num_new_tokens} tokens")
        for b in cached_blocks:
            if self._ref[b] == 0:
                del self._free_cached[b]
            self._ref[b] += 1
        num_cached = len(cached_blocks) * self.block_size
        seq.block_table = list(cached_blocks)
        seq.num_cached_tokens = num_cached
        seq.num_computed_tokens = num_cached
        self._num_hashed[seq.seq_id] = len(cached_blocks)
        self._grow(seq, num_cached + num_new_tokens)
        return num_cached

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow seq.block_table to hold its computed tokens plus `num_new_tokens`. False (and no change)
        when there are not enough free blocks."""
        if not self.can_append(seq, num_new_tokens):
            return False
        self._grow(seq, seq.num_computed_tokens + num_new_tokens)
        return True

    def mark_computed(self, seq: Sequence) -> None:
        """Register the hashes of seq's blocks that became full and computed (call after advancing
        seq.num_computed_tokens). A block whose content is already cached elsewhere stays private."""
        if not self.enable_prefix_caching:
            return
        done = self._num_hashed.get(seq.seq_id)
        if done is None:
            raise RuntimeError(f"seq {seq.seq_id} holds no blocks")
        full = seq.num_computed_tokens // self.block_size
        if full <= done:   # the common case, a decode inside its last block: nothing became full
            return
        full = min(full, len(seq.block_table))
        if full <= done:
            return
        hashes = self.block_hashes(seq, full)
        for i in range(done, full):
            block = seq.block_table[i]
            if hashes[i] not in self._by_hash and self._hash[block] is None:
                self._hash[block] = hashes[i]
                self._by_hash[hashes[i]] = block
        self._num_hashed[seq.seq_id] = full

    def mark_computed_all(self, seqs: list[Sequence]) -> None:
        """`mark_computed` of each of `seqs`, in order; a row in which no block became full (a decode inside
        its last block: 15 of 16 steps) costs one comparison instead of a call."""
        if not self.enable_prefix_caching:
            return
        bs, done = self.block_size, self._num_hashed.get
        for seq in [q for q in seqs if q.num_computed_tokens // bs > done(q.seq_id, -1)]:
            self.mark_computed(seq)   # raises for a sequence without blocks (done -1 always passes)

    def free(self, seq: Sequence) -> None:
        """Drop seq's references (tail first, so its tail blocks are the first cached ones evicted)
        and clear seq.block_table. Hashed blocks reaching refcount 0 stay cached in the LRU."""
        for b in reversed(seq.block_table):
            self._ref[b] -= 1
            if self._ref[b] < 0:
                raise RuntimeError(f"block {b} refcount went negative freeing seq {seq.seq_id}")
            if self._ref[b] == 0:
                if self._hash[b] is not None:
                    self._free_cached[b] = None
                else:
                    self._free_plain.append(b)
        seq.block_table = []
        self._num_hashed.pop(seq.seq_id, None)

    def preempt(self, seq: Sequence) -> None:
        """Release a preempted `seq` (recomputed later): here the same as `free`; a manager that can keep
        part of the state for a cheaper restore overrides it (core/window_blocks.py)."""
        self.free(seq)

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self._num_new_blocks(len(seq.block_table), num_tokens)):
            seq.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        if self._free_plain:
            b = self._free_plain.popleft()
        else:
            b, _ = self._free_cached.popitem(last=False)   # evict the least recently freed
            h = self._hash[b]
            self._hash[b] = None
            del self._by_hash[h]
        self._ref[b] = 1
        return b

    # ---- debugging -----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError when the bookkeeping is inconsistent (used by tests)."""
        plain, cached = set(self._free_plain), set(self._free_cached)
        assert len(plain) == len(self._free_plain), "a block is twice in the plain free list"
        assert not plain & cached, f"blocks in both free structures: {sorted(plain & cached)}"
        for b in range(self.num_blocks):
            r = self._ref[b]
            assert r >= 0, f"block {b} has refcount {r}"
            is_free = b in plain or b in cached
            assert is_free == (r == 0), f"block {b}: refcount {r} but free={is_free}"
            if b in cached:
                assert self._hash[b] is not None, f"cached free block {b} has no hash"
            if b in plain:
                assert self._hash[b] is None, f"plain free block {b} keeps a hash"
        for h, b in self._by_hash.items():
            assert self._hash[b] == h, f"hash map points to block {b} whose hash differs"
        assert sum(h is not None for h in self._hash) == len(self._by_hash), "orphan block hash"
