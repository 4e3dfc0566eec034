"""The exact mask cache by token history (structured/mask_cache.py): a cached or shared mask is bitwise the
mask llguidance computes for the row's own matcher, the trie stays bounded, and engine outputs are the same
with the cache on and off (overlapped and synchronous loops)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.structured.mask_cache import MaskCache

from tests.support.structured_demo import demo_manager

SCHEMA = {"type": "object",
          "properties": {"label": {"enum": ["pos", "neg", "neutral"]}, "n": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                  "maxItems": 2}},
          "required": ["label", "n", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    # state_keys=False: this file tests the token-history trie (SCHEMA's free strings would otherwise put it
    # on state keys, tested in test_structured_state_key.py).
    with demo_manager(tmp_path_factory.mktemp("cache_tok"), 40, max_threads=2, steering=False,
                      mask_cache_size=64, state_keys=False) as m:
        yield m


def _seq(manager, params):
    s = SimpleNamespace(params=params, grammar=None, num_output_tokens=0, num_tokens=5)
    manager.add(s)
    return s


def test_cached_masks_equal_fresh_masks_over_random_walks(manager):
    """Rows that mostly pick the same allowed tokens share histories (cache hits); each step every row's slot
    must equal a fresh llguidance fill of that row's matcher, bit for bit."""
    rng = random.Random(3)
    before = manager.mask_stats()
    seqs = [_seq(manager, SamplingParams(max_tokens=40, json_schema=SCHEMA)) for _ in range(12)]
    fresh = manager.allocate_bitmask(1)
    for _ in range(40):
        alive = [s for s in seqs if s.grammar is not None]
        if not alive:
            break
        job = manager.masks_for(alive)
        job.wait()
        for s in alive:
            manager.backend.fill_bitmasks([(0, s.grammar.matcher)], fresh)
            assert torch.equal(manager.slots.buffer[s.grammar.slot], fresh[0])
            row = np.unpackbits(fresh[0].numpy().view(np.uint8), bitorder="little")[: manager.vocab_size]
            allowed = np.flatnonzero(row)
            # Mostly the lowest allowed token (shared histories), sometimes a random one (divergence).
            tok = int(allowed[0] if rng.random() < 0.7 else rng.choice(allowed))
            s.num_output_tokens += 1
            s.num_tokens += 1
            if manager.advance(s, tok) or s.num_output_tokens >= 40:
                manager.free(s)
    after = manager.mask_stats()
    reused = (after["mask_cache_hits"] - before["mask_cache_hits"]
              + after["mask_cache_shared"] - before["mask_cache_shared"])
    assert reused >= 12, reused  # the initial state alone is shared by all 12 rows
    for s in seqs:
        manager.free(s)
    manager.slots.wait_idle()
    stats = manager.mask_cache.stats()
    assert stats["mask_cache_masks"] <= 64
    # Nobody stands on the trie any more: only the paths to stored masks are left.
    assert stats["mask_cache_nodes"] <= 64 * 41


def test_trie_prunes_unshared_paths_and_keeps_only_shared_masks():
    cache = MaskCache(words=2, max_masks=1)
    a, b = cache.start("g"), cache.start("g")
    assert a is b and a.hits == 2
    cache.store(a, np.array([1, 2], dtype=np.int32))
    assert cache.lookup(a) is not None                       # reached twice: kept
    a2 = cache.step(a, 7)
    cache.store(a2, np.array([3, 4], dtype=np.int32))
    assert cache.lookup(a2) is None                          # one request only: not kept
    b2 = cache.step(b, 7)
    assert b2 is a2 and a2.hits == 2
    cache.store(a2, np.array([3, 4], dtype=np.int32))        # the LRU (1 mask) drops the root's mask
    assert cache.lookup(a2).tolist() == [3, 4] and a.row < 0
    cache.leave(a2)
    cache.leave(b2)
    assert cache.stats()["mask_cache_nodes"] == 2            # root + the node holding the mask
    c = cache.start("g")
    c2 = cache.step(c, 9)                                    # a unique path, pruned when left
    cache.leave(c2)
    assert cache.stats()["mask_cache_nodes"] == 2 and not c2.attached
    off = MaskCache(words=2, max_masks=0)
    assert off.start("g") is None
    with pytest.raises(ValueError, match="max_masks"):
        MaskCache(words=2, max_masks=-1)


def test_rejected_token_takes_the_row_off_the_trie(manager):
    s = _seq(manager, SamplingParams(max_tokens=8, json_schema=SCHEMA))
    assert s.grammar.node is not None
    manager.masks_for([s]).wait()
    manager.accept(s.grammar, 0)  # id 0 is not `{`: rejected, the matcher is in error
    assert s.grammar.node is None and s.grammar.matcher.is_error()
    manager.free(s)


def _generate(tiny_checkpoint, monkeypatch, cache: str, sync: str):
    monkeypatch.setenv("DEEPINFER_MASK_CACHE", cache)
    monkeypatch.setenv("DEEPINFER_SYNC_LOOP", sync)
    llm = LLM(model=str(tiny_checkpoint("llama")), device="cpu", cpu_kv_cache_gib=0.25)
    params = [SamplingParams(temperature=1.0 if i % 2 else 0.0, seed=i, max_tokens=24, json_schema=SCHEMA)
              for i in range(10)]
    outs = llm.generate([f"Answer {i % 3}: " for i in range(10)], params, use_tqdm=False)
    stats = llm.structured.mask_stats()
    return [o.token_ids for o in outs], stats


@pytest.mark.parametrize("sync", ["0", "1"], ids=["overlapped", "synchronous"])
def test_engine_outputs_identical_with_and_without_mask_cache(tiny_checkpoint, monkeypatch, sync):
    on, stats_on = _generate(tiny_checkpoint, monkeypatch, "1", sync)
    off, stats_off = _generate(tiny_checkpoint, monkeypatch, "0", sync)
    assert on == off
    assert stats_on["mask_cache_hits"] + stats_on["mask_cache_shared"] > 0
    assert stats_off["mask_cache_lookups"] == 0
