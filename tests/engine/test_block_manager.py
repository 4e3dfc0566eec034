"""Specification of the KV block manager: allocation, refcounts, chained prefix hashes, LRU eviction."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
from deepinfer.engine.core.block_manager import BlockManager, hash_block
from deepinfer.engine.core.sequence import Sequence
from deepinfer.engine.sample.params import SamplingParams

BS = 16


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id=seq_id, prompt_token_ids=list(tokens), params=SamplingParams(), seed=seq_id)


def admit_and_compute(bm: BlockManager, seq: Sequence) -> int:
    """Admit `seq` with its whole uncached remainder, 'compute' it and register its full blocks."""
    hits = bm.match_prefix(seq)
    n = seq.num_tokens - len(hits) * bm.block_size
    assert bm.can_allocate(seq, n, hits)
    cached = bm.allocate(seq, n, hits)
    seq.num_computed_tokens = seq.num_tokens
    bm.mark_computed(seq)
    bm.check_invariants()
    return cached


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# ---- hashes ------------------------------------------------------------------------------------
def test_hash_chains_over_the_prefix():
    block = tokens(100, BS)
    h_a = hash_block(hash_block(b"", tokens(0, BS)), block)
    h_b = hash_block(hash_block(b"", tokens(1, BS)), block)
    assert h_a != h_b, "the same block after a different prefix must hash differently"
    assert h_a == hash_block(hash_block(b"", tokens(0, BS)), list(block))
    assert hash_block(b"", [1, 2]) != hash_block(b"", [2, 1])
    assert hash_block(b"", [1 << 40]) != hash_block(b"", [0])


def test_hash_is_stable_across_processes():
    code = (
        "from deepinfer.engine.core.block_manager import hash_block;"
        "print(hash_block(hash_block(b'', list(range(16))), [7] * 16).hex())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert other.stdout.strip() == hash_block(hash_block(b"", list(range(16))), [7] * 16).hex()


# ---- allocation and freeing --------------------------------------------------------------------
@pytest.mark.parametrize(
    "num_tokens, expected_blocks",
    [(1, 1), (15, 1), (16, 1), (17, 2), (48, 3), (49, 4)],
)
def test_allocate_takes_ceil_blocks_and_free_returns_them(num_tokens, expected_blocks):
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    seq = make_seq(1, tokens(0, num_tokens))
    assert bm.allocate(seq, num_tokens, []) == 0
    assert seq.block_table == list(range(expected_blocks)), "block 0 is a normal block, handed out first"
    assert bm.num_free_blocks == 8 - expected_blocks
    assert bm.usage == pytest.approx(expected_blocks / 8)
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8 and bm.usage == 0.0
    bm.check_invariants()


@pytest.mark.parametrize(
    "computed, table_len, new_tokens, blocks_after",
    [(16, 1, 1, 2), (15, 1, 1, 1), (17, 2, 15, 2), (17, 2, 16, 3), (0, 0, 40, 3)],
)
def test_append_slots_grows_to_computed_plus_new(computed, table_len, new_tokens, blocks_after):
    bm = BlockManager(4, BS)
    seq = make_seq(1, tokens(0, 64))
    bm.allocate(seq, computed, [])
    seq.num_computed_tokens = computed
    assert len(seq.block_table) == table_len
    assert bm.append_slots(seq, new_tokens)
    assert len(seq.block_table) == blocks_after
    bm.check_invariants()


def test_append_slots_fails_without_side_effects_when_full():
    bm = BlockManager(2, BS)
    seq = make_seq(1, tokens(0, 64))
    bm.allocate(seq, 32, [])
    seq.num_computed_tokens = 32
    assert not bm.can_append(seq, 1)
    assert not bm.append_slots(seq, 1)
    assert seq.block_table == [0, 1]
    with pytest.raises(RuntimeError, match="not enough free blocks"):
        bm.allocate(make_seq(2, tokens(0, 4)), 4, [])
    bm.check_invariants()


# ---- prefix caching ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "second_prompt_len, shared_prefix, expected_cached",
    [
        (50, 48, 48),   # three full shared blocks
        (49, 48, 48),   # one token left to compute
        (48, 48, 32),   # whole prompt cached: capped so the last block is recomputed for logits
        (40, 40, 32),   # partial third block is never cached
        (50, 20, 16),   # divergence inside block 1
        (50, 0, 0),     # different first token: no hit
        (1, 1, 0),
    ],
)
def test_prefix_hits_and_capping(second_prompt_len, shared_prefix, expected_cached):
    bm = BlockManager(16, BS)
    first = make_seq(1, tokens(0, 50))
    admit_and_compute(bm, first)
    second_tokens = tokens(0, shared_prefix) + tokens(1000, second_prompt_len - shared_prefix)
    second = make_seq(2, second_tokens)
    cached = admit_and_compute(bm, second)
    assert cached == expected_cached
    assert second.num_cached_tokens == expected_cached
    nb = expected_cached // BS
    assert second.block_table[:nb] == first.block_table[:nb], "hits share the first sequence's blocks"
    for b in first.block_table[:nb]:
        assert bm.ref_count(b) == 2
    assert len(second.block_table) == -(-second_prompt_len // BS)


def test_free_cached_block_is_revived_on_hit_and_can_allocate_counts_it():
    bm = BlockManager(4, BS)
    first = make_seq(1, tokens(0, 48))
    admit_and_compute(bm, first)
    first_blocks = list(first.block_table)
    bm.free(first)
    # All three blocks are full and computed, so all three stay cached after the free.
    assert bm.num_cached_free_blocks == 3 and bm.num_free_blocks == 4
    second = make_seq(2, tokens(0, 48) + tokens(500, 16))
    hits = bm.match_prefix(second)
    assert hits == first_blocks == [0, 1, 2]
    # 3 revived + 1 new = 4 blocks: fits exactly; one more token would not.
    assert bm.can_allocate(second, 16, hits)
    assert not bm.can_allocate(second, 17, hits)
    bm.allocate(second, 16, hits)
    assert [bm.ref_count(b) for b in second.block_table] == [1, 1, 1, 1]
    assert bm.num_free_blocks == 0 and bm.num_cached_free_blocks == 0
    bm.check_invariants()


def test_referenced_block_is_never_evicted():
    bm = BlockManager(4, BS)
    holder = make_seq(1, tokens(0, 32))
    admit_and_compute(bm, holder)           # holds blocks 0, 1 (hashed, refcount 1)
    other = make_seq(2, tokens(900, 48))
    assert not bm.can_allocate(other, 48, [])
    assert bm.can_allocate(other, 32, [])
    bm.allocate(other, 32, [])
    assert set(other.block_table).isdisjoint(holder.block_table)
    assert bm.match_prefix(make_seq(3, tokens(0, 33))) == holder.block_table
    bm.check_invariants()


def test_lru_evicts_least_recently_freed_tail_first():
    bm = BlockManager(6, BS)
    a = make_seq(1, tokens(0, 48))      # 3 full hashed blocks
    b = make_seq(2, tokens(200, 48))    # 3 full hashed blocks
    admit_and_compute(bm, a)
    admit_and_compute(bm, b)
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4, 5])
    bm.free(a)   # LRU: a2, a1, a0 (tail first)
    bm.free(b)   # then b2, b1, b0
    assert bm.num_cached_free_blocks == 6
    evicted_order = []
    for i in range(6):
        taker = make_seq(10 + i, tokens(5000 + 100 * i, 1))
        bm.allocate(taker, 1, [])
        evicted_order.append(taker.block_table[0])
        bm.check_invariants()
    assert evicted_order == [2, 1, 0, 5, 4, 3], "a freed first (tail first), then b"
    assert bm.match_prefix(make_seq(30, tokens(0, 49))) == []


def test_plain_free_blocks_are_used_before_evicting_cached_ones():
    bm = BlockManager(4, BS)
    a = make_seq(1, tokens(0, 32))
    admit_and_compute(bm, a)
    bm.free(a)
    c = make_seq(2, tokens(700, 32))
    bm.allocate(c, 32, [])
    assert c.block_table == [2, 3]
    assert bm.match_prefix(make_seq(3, tokens(0, 33))) == [0, 1], "cached blocks survive"


def test_duplicate_content_computed_concurrently_stays_private():
    bm = BlockManager(8, BS)
    a, b = make_seq(1, tokens(0, 20)), make_seq(2, tokens(0, 20))
    for s in (a, b):                         # both admitted before either registered its blocks
        bm.allocate(s, 20, bm.match_prefix(s))
    for s in (a, b):
        s.num_computed_tokens = 20
        bm.mark_computed(s)
    assert bm.match_prefix(make_seq(3, tokens(0, 17))) == [a.block_table[0]]
    bm.free(b)
    bm.free(a)
    assert bm.num_cached_free_blocks == 1 and bm.num_free_blocks == 8
    bm.check_invariants()


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_seq(1, tokens(0, 48))
    admit_and_compute(bm, a)
    bm.free(a)
    assert bm.num_cached_free_blocks == 0
    assert admit_and_compute(bm, make_seq(2, tokens(0, 60))) == 0


def test_mark_computed_registers_blocks_incrementally():
    bm = BlockManager(8, BS)
    a = make_seq(1, tokens(0, 40))
    bm.allocate(a, 40, [])
    for computed, expected_hits in [(10, 0), (16, 1), (31, 1), (32, 2), (40, 2)]:
        a.num_computed_tokens = computed
        bm.mark_computed(a)
        assert len(bm.match_prefix(make_seq(99, tokens(0, 40)))) == expected_hits


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_keeps_invariants_and_returns_every_block(seed):
    rng = random.Random(seed)
    bm = BlockManager(12, 4)
    live: list[Sequence] = []
    prefixes = [[rng.randrange(5) for _ in range(12)] for _ in range(3)]
    for step in range(300):
        if live and (rng.random() < 0.4 or bm.num_free_blocks == 0):
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            extra = [rng.randrange(5) for _ in range(rng.randrange(4))]
            toks = rng.choice(prefixes)[: rng.randrange(1, 13)] + extra
            seq = make_seq(step, toks)
            hits = bm.match_prefix(seq)
            n = seq.num_tokens - len(hits) * 4
            if bm.can_allocate(seq, n, hits):
                bm.allocate(seq, n, hits)
                seq.num_computed_tokens = seq.num_tokens
                bm.mark_computed(seq)
                live.append(seq)
        bm.check_invariants()
        assert bm.num_free_blocks + len({b for s in live for b in s.block_table}) == 12
    for s in live:
        bm.free(s)
    bm.check_invariants()
    assert bm.num_free_blocks == 12 and all(bm.ref_count(b) == 0 for b in range(12))
