"""The inputs of a CUDA-graph prefill step on CPU (runner/prefill_inputs.py): token buckets, the padded step
(padding sequence, empty sequences, the static attention plan and its capacity), the static buffers and the
metadata a graph is captured with."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from deepinfer.engine.runner.host_step import HostStep
from deepinfer.engine.runner.input_buffers import PAD_SLOT
from deepinfer.engine.runner.prefill_inputs import (
    StaticPrefillBuffers,
    pad_prefill,
    plan_capacity,
    prefill_buckets,
    prefill_graph_metadata,
)
from deepinfer.kernels.reference.attention import check_attention_args


@pytest.mark.parametrize("max_tokens,first,step,expected", [
    (16384, 256, 2048, [256, 512, 1024] + list(range(2048, 16385, 2048))),
    (8192, 256, 2048, [256, 512, 1024, 2048, 4096, 6144, 8192]),
    (5000, 256, 2048, [256, 512, 1024, 2048, 4096, 5000]),
    (300, 256, 2048, [256, 300]),
    (100, 256, 2048, [100]),
    (48, 8, 16, [8, 16, 32, 48]),
])
def test_buckets_double_then_step_and_end_at_the_budget(max_tokens, first, step, expected):
    assert prefill_buckets(max_tokens, first, step) == expected


def test_buckets_reject_a_zero_budget():
    with pytest.raises(ValueError, match="must be >= 1"):
        prefill_buckets(0)


def _step(query_lens: list[int], contexts: list[int], rng: random.Random, width: int = 8) -> HostStep:
    """A step of sequences with `contexts[b]` tokens before this step's `query_lens[b]`; block size 4."""
    ids, pos, slots, tables, seq_lens = [], [], [], [], []
    for q, c in zip(query_lens, contexts, strict=True):
        blocks = [rng.randrange(1, 200) for _ in range(-(-(c + q) // 4))]
        tables.append(blocks + [0] * (width - len(blocks)))
        for p in range(c, c + q):
            ids.append(rng.randrange(1, 99))
            pos.append(p)
            slots.append(blocks[p // 4] * 4 + p % 4)
        seq_lens.append(c + q)
    i64 = np.int64
    return HostStep(np.array(ids, dtype=i64), np.array(pos, dtype=i64), np.array(slots, dtype=i64),
                    list(query_lens), seq_lens, np.array(tables, dtype=np.int32), [])


def test_padding_sequence_holds_the_padding_tokens():
    step = _step([5, 1, 3], [0, 9, 4], random.Random(0))
    p = pad_prefill(step, bucket=16, max_seqs=5, block_q=2)
    assert p.num_tokens == 9 and p.bucket == 16
    assert p.input_ids[:9].tolist() == step.input_ids.tolist() and p.input_ids[9:].tolist() == [0] * 7
    assert p.positions[9:].tolist() == [0] * 7 and p.slot_mapping[9:].tolist() == [PAD_SLOT] * 7
    # sequences 0-2 the step's, 3-4 empty, 5 the padding sequence (its 7 tokens at position 0, context 1)
    assert p.query_lens == [5, 1, 3, 0, 0, 7] and p.seq_lens == [5, 10, 7, 1, 1, 1]
    assert p.query_start_loc.tolist() == [0, 5, 6, 9, 9, 9, 16]


def _programs(plan: np.ndarray) -> list[tuple[int, int]]:
    return list(zip(plan[0::2].tolist(), plan[1::2].tolist(), strict=True))


@pytest.mark.parametrize("seed", range(40))
def test_plan_covers_every_query_block_once_then_stores_nothing(seed):
    """Random steps up to a full bucket and max_seqs sequences: the plan lists every (sequence, query
    block) of the real and padding sequences once, fits the capacity, and fills the rest with programs
    whose query block starts past every token of the padding sequence (no row of them is stored)."""
    rng = random.Random(seed)
    max_seqs, block_q = rng.randint(1, 6), rng.choice([1, 2, 3, 9])
    bucket = rng.randint(1, 64)
    b = rng.randint(1, max_seqs)
    cuts = sorted(rng.sample(range(1, bucket + 1), min(b, bucket)))[: b]
    total = rng.randint(len(cuts), bucket)
    query_lens = [1] * len(cuts)
    for _ in range(total - len(cuts)):
        query_lens[rng.randrange(len(cuts))] += 1
    p = pad_prefill(_step(query_lens, [rng.randint(0, 9) for _ in query_lens], rng, width=32), bucket,
                    max_seqs, block_q)
    assert p.plan is not None and p.plan.shape[0] == 2 * plan_capacity(bucket, max_seqs, block_q)
    needed = [(s, qb) for s, q in enumerate(p.query_lens) for qb in range(-(-q // block_q))]
    progs = _programs(p.plan)
    assert sorted(progs[: len(needed)]) == sorted(needed)
    pad_len = p.query_lens[max_seqs]
    for s, qb in progs[len(needed):]:
        assert s == max_seqs and qb * block_q >= pad_len


def test_pad_prefill_rejects_steps_that_do_not_fit():
    step = _step([5, 1, 3], [0, 9, 4], random.Random(0))
    with pytest.raises(ValueError, match="does not fit a bucket of 8"):
        pad_prefill(step, bucket=8, max_seqs=5, block_q=2)
    with pytest.raises(ValueError, match="exceeds max_seqs=2"):
        pad_prefill(step, bucket=16, max_seqs=2, block_q=2)


def test_static_buffers_take_steps_and_keep_the_padding_table_zero():
    rng = random.Random(3)
    buf = StaticPrefillBuffers(max_tokens=32, max_seqs=3, max_blocks_per_seq=8, block_q=2,
                               device=torch.device("cpu"))
    first = pad_prefill(_step([7, 9, 4], [0, 3, 1], rng), 32, 3, 2)
    buf.load(first)
    second = pad_prefill(_step([3], [5], rng), 16, 3, 2)
    buf.load(second)
    assert buf.input_ids[:16].tolist() == second.input_ids.tolist()
    assert buf.input_ids[16:20].tolist() == first.input_ids[16:20].tolist()   # past the bucket: untouched
    assert buf.query_start_loc.tolist() == second.query_start_loc.tolist()
    assert buf.block_tables[0].tolist() == second.block_tables[0].tolist()
    assert buf.block_tables[3].tolist() == [0] * 8    # the padding sequence's row
    assert buf.plan[: second.plan.shape[0]].tolist() == second.plan.tolist()
    assert buf.last is second
    with pytest.raises(ValueError, match="exceeds the buffers"):
        buf.load(pad_prefill(_step([3], [5], rng, width=9), 16, 3, 2))


@pytest.mark.parametrize("live", [False, True])
def test_graph_metadata_passes_the_attention_checks(live):
    rng = random.Random(5)
    buf = StaticPrefillBuffers(max_tokens=32, max_seqs=4, max_blocks_per_seq=8, block_q=2,
                               device=torch.device("cpu"))
    buf.load(pad_prefill(_step([7, 1], [0, 3], rng), 16, 4, 2))
    meta = prefill_graph_metadata(buf, 16, block_size=4, live=live)
    q = torch.zeros(16, 4, 16)
    cache = torch.zeros(200, 4, 2, 16)
    check_attention_args(q, cache, cache, meta)
    assert meta.max_query_len > 1 and meta.plan_block_q == 2
    assert meta.prefill_plan.shape[0] == 2 * plan_capacity(16, 4, 2)
    expected = [7, 1, 0, 0, 8] if live else [0, 0, 0, 0, 16]
    assert meta.query_lens_cpu == expected
