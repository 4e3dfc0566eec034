"""The incremental decode staging (input_buffers.DecodeStager) equals a from-scratch pad_decode every step,
whatever happened to the batch in between: sequences added, finished, preempted and re-admitted with a new
table (of the same length too), tables grown by a block, entries edited in place, buckets up and down."""

from __future__ import annotations

import random

import numpy as np
import pytest
from deepinfer.engine.runner.input_buffers import (
    DecodeRow,
    DecodeStager,
    graph_buckets,
    pad_decode,
    pick_bucket,
)

BS = 4
MAX_BATCH = 24
MAX_BLOCKS = 9


class _Seq:
    def __init__(self, rng: random.Random, next_block: list[int]) -> None:
        self.position = rng.randrange(0, BS * (MAX_BLOCKS - 2))
        self.table = [self._block(next_block) for _ in range(self.position // BS + 1)]
        self.token = rng.randrange(-1, 50)

    @staticmethod
    def _block(next_block: list[int]) -> int:
        next_block[0] += 1
        return next_block[0] % 97

    def step(self, rng: random.Random, next_block: list[int]) -> None:
        self.position += 1
        self.token = rng.randrange(-1, 50)
        if self.position // BS >= len(self.table):
            self.table.append(self._block(next_block))   # in place, as BlockManager._grow does


def _assert_same(rng_seed: int, steps: int) -> None:
    rng = random.Random(rng_seed)
    next_block = [0]
    buckets = graph_buckets(MAX_BATCH)
    stager = DecodeStager(MAX_BATCH, MAX_BLOCKS, BS)
    batch = [_Seq(rng, next_block) for _ in range(rng.randrange(1, MAX_BATCH + 1))]
    for _ in range(steps):
        for s in batch:
            if s.position + 1 < BS * MAX_BLOCKS:
                s.step(rng, next_block)
        event = rng.random()
        if event < 0.2 and len(batch) > 1:       # some finish
            for _ in range(rng.randrange(1, len(batch))):
                batch.pop(rng.randrange(len(batch)))
        elif event < 0.4:                        # admitted ones join (at the end or in between)
            for _ in range(rng.randrange(1, 6)):
                if len(batch) < MAX_BATCH:
                    batch.insert(rng.randrange(len(batch) + 1), _Seq(rng, next_block))
        elif event < 0.55:                       # preempted and re-admitted: a new table, same length
            s = rng.choice(batch)
            s.table = [_Seq._block(next_block) for _ in s.table]
        elif event < 0.65:                       # an entry edited in place (window_blocks releases so)
            s = rng.choice(batch)
            s.table[rng.randrange(len(s.table))] = 96
        elif event < 0.75:                       # a sequence shrinks back (preempted, shorter table)
            s = rng.choice(batch)
            s.position = rng.randrange(0, BS)
            s.table = [_Seq._block(next_block)]
        if event > 0.9:
            rng.shuffle(batch)
        bucket = pick_bucket(buckets, len(batch))
        want = pad_decode([DecodeRow(s.token, s.position, list(s.table)) for s in batch], bucket, BS)
        got = stager.stage([s.token for s in batch], [s.position for s in batch], [s.table for s in batch],
                           bucket)
        assert (got.num_real, got.bucket) == (want.num_real, want.bucket)
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and np.array_equal(a, b), name


@pytest.mark.parametrize("seed", range(6))
def test_stager_equals_a_rebuild_after_random_batch_changes(seed):
    _assert_same(seed, steps=60)


def test_stager_rejects_what_pad_decode_rejects():
    stager = DecodeStager(4, 2, BS)
    with pytest.raises(ValueError, match="past its"):
        stager.stage([1], [BS], [[3]], 1)
    with pytest.raises(ValueError, match="do not fit"):
        stager.stage([1, 2], [0, 0], [[3], [4]], 1)
    with pytest.raises(ValueError, match="exceed"):
        stager.stage([1], [0], [[1, 2, 3]], 1)


def test_staged_arrays_do_not_change_with_later_steps():
    stager = DecodeStager(4, 3, BS)
    first = stager.stage([1], [0], [[5]], 1)
    stager.stage([2], [0], [[7]], 1)
    assert first.block_tables.tolist() == [[5]]


def test_lockstep_decoding_through_staged_graph_inputs_gives_the_eager_outputs(model_dir):
    """Requests decoding in lockstep: every graph step's rows are the previous step's sampled rows in the same
    order, so each placeholder input is one row-for-row device copy (cuda_graphs.DecodeGraphs.stage); their
    tokens are those of the eager synchronous engine."""
    import torch
    from deepinfer.engine import LLM, SamplingParams
    from deepinfer.engine.runner.cuda_graphs import DecodeGraphs

    llm = LLM(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=64, async_scheduling=False)
    rng = random.Random(3)
    vocab = llm.model_config.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(7)] for _ in range(5)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    params = [greedy, sampled, greedy, sampled, greedy]
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, 512, 8, torch.device("cpu"))
    graphs.stand_in_replays()
    llm.engine.executor.graphs = graphs
    llm.engine.async_scheduling = True
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == eager
    assert llm.get_stats()["graph_steps"] >= 10
