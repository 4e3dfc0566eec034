"""Specification of the continuous-batching scheduler, driven by a model-free engine loop
(tests/support/scheduler_harness.py). The finish rules are specified in test_finish.py."""

from __future__ import annotations

import pytest
from deepinfer.engine.core.block_manager import BlockManager
from deepinfer.engine.core.config import CacheConfig, SchedulerConfig
from deepinfer.engine.core.scheduler import Scheduler
from deepinfer.engine.core.sequence import SequenceStatus

from tests.support.scheduler_harness import PagedKVRunner, make_scheduler, make_seq, prompt, run


def reference_outputs(seqs_spec: list[tuple[int, list[int], int]]) -> dict[int, list[int]]:
    """Each sequence alone in a roomy cache without prefix caching."""
    res = {}
    for sid, p, max_tokens in seqs_spec:
        sched = make_scheduler(num_blocks=64, budget=512, prefix=False)
        seq = make_seq(sid, p, max_tokens=max_tokens)
        sched.add(seq)
        run(sched, PagedKVRunner(64, 16))
        res[sid] = seq.output_token_ids
    return res


WORKLOAD = [(i, prompt(i, n), mt) for i, (n, mt) in enumerate(
    [(5, 12), (40, 6), (70, 9), (3, 20), (33, 4), (16, 10), (90, 5), (1, 7), (48, 8), (20, 15)]
)]
REFERENCE = reference_outputs(WORKLOAD)


# ---- step limits, chunking, preemption: outputs never depend on the schedule ---------------------
@pytest.mark.parametrize(
    "num_blocks, block_size, budget, max_seqs, chunked, prefix",
    [
        (64, 16, 512, 16, True, True),    # roomy: everything at once
        (64, 16, 32, 16, True, True),     # tight token budget: chunked prefills mixed with decodes
        (64, 16, 7, 16, True, False),     # budget below a block: unaligned chunks
        (64, 16, 512, 2, True, True),     # max_num_seqs caps the batch
        (64, 16, 512, 1, True, False),    # one sequence at a time
        (8, 16, 64, 8, True, True),       # tiny cache: preemption by recompute
        (8, 16, 64, 8, True, False),
        (30, 4, 24, 4, True, True),       # small blocks, everything tight
        (64, 16, 512, 8, False, True),    # no chunked prefill (budget >= max_model_len)
    ],
)
def test_outputs_are_independent_of_the_schedule(num_blocks, block_size, budget, max_seqs, chunked, prefix):
    max_model_len = 512 if chunked else budget
    sched = make_scheduler(num_blocks, block_size, budget, max_seqs, max_model_len, chunked, prefix)
    seqs = [make_seq(sid, p, max_tokens=mt) for sid, p, mt in WORKLOAD]
    for s in seqs:
        sched.add(s)
    run(sched, PagedKVRunner(num_blocks, block_size))
    for s in seqs:
        assert s.output_token_ids == REFERENCE[s.seq_id]
        assert s.finish_reason == "length" and s.block_table == []


def test_tiny_cache_preempts_and_preempted_sequences_recompute():
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64, max_seqs=4, prefix=False)
    seqs = [make_seq(i, prompt(i, 6), max_tokens=12) for i in range(3)]
    for s in seqs:
        sched.add(s)
    runner = PagedKVRunner(6, 4)
    preempted_seen = []
    while sched.has_unfinished():
        running_before = {r.seq_id for r in sched.running}
        out = sched.schedule()
        if out.preempted:
            assert {s.seq.seq_id for s in out.scheduled} <= running_before, "no admission when preempting"
        for v in out.preempted:
            preempted_seen.append(v.seq_id)
            assert v.status == SequenceStatus.WAITING and v.num_computed_tokens == 0 and v.block_table == []
            assert sched.waiting[0].seq_id == out.preempted[-1].seq_id, "preempted go to the waiting front"
            assert all(v.arrival >= r.arrival for r in sched.running), "the newest running one is the victim"
        sched.update(out, runner.execute(out))
    assert preempted_seen, "a 6-block cache must preempt three 18-token sequences"
    assert sum(s.num_preemptions for s in seqs) == len(preempted_seen)
    ref = reference_outputs([(i, prompt(i, 6), 12) for i in range(3)])
    assert {s.seq_id: s.output_token_ids for s in seqs} == ref


# ---- chunked prefill ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prompt_len, budget, expected_prefill_chunks",
    [
        (100, 32, [(0, 32), (32, 32), (64, 32), (96, 4)]),
        (100, 40, [(0, 32), (32, 32), (64, 36)]),        # chunk ends rounded down to block boundaries
        (100, 24, [(0, 16), (16, 16), (32, 16), (48, 16), (64, 16), (80, 20)]),
        (60, 10, [(0, 10), (10, 10), (20, 10), (30, 10), (40, 10), (50, 10)]),   # budget below a block
        (30, 32, [(0, 30)]),
    ],
)
def test_chunked_prefill_then_decode(prompt_len, budget, expected_prefill_chunks):
    sched = make_scheduler(budget=budget)
    seq = make_seq(0, prompt(0, prompt_len), max_tokens=3)
    sched.add(seq)
    steps, _ = run(sched, PagedKVRunner(64, 16))
    chunks = [(start, n) for ((_, start, n, _),) in steps]
    samples = [sample for ((*_, sample),) in steps]
    k = len(expected_prefill_chunks)
    assert chunks[:k] == expected_prefill_chunks
    assert samples == [False] * (k - 1) + [True] * 3
    assert chunks[k:] == [(prompt_len, 1), (prompt_len + 1, 1)], "then one-token decodes"


def test_prefill_chunks_mix_with_decodes():
    sched = make_scheduler(budget=20)
    short, long = make_seq(0, prompt(0, 4), max_tokens=6), make_seq(1, prompt(1, 60), max_tokens=2)
    sched.add(short)
    sched.add(long)
    steps, _ = run(sched, PagedKVRunner(64, 16))
    assert steps[0] == [(0, 0, 4, True), (1, 0, 16, False)]
    assert steps[1] == [(0, 4, 1, True), (1, 16, 16, False)]
    assert steps[2] == [(0, 5, 1, True), (1, 32, 16, False)]
    assert steps[3] == [(0, 6, 1, True), (1, 48, 12, True)]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched = make_scheduler(budget=64, max_model_len=64, chunked=False)
    a, b = make_seq(0, prompt(0, 40), max_tokens=3), make_seq(1, prompt(1, 40), max_tokens=3)
    sched.add(a)
    sched.add(b)
    steps, _ = run(sched, PagedKVRunner(64, 16))
    assert steps[0] == [(0, 0, 40, True)]
    assert steps[1] == [(0, 40, 1, True), (1, 0, 40, True)]


# ---- admission order and limits -----------------------------------------------------------------
def test_admission_is_fcfs_and_max_num_seqs_holds():
    sched = make_scheduler(max_seqs=2)
    seqs = [make_seq(i, prompt(i, 5 + i), max_tokens=3 + (i % 2)) for i in range(5)]
    for s in seqs:
        sched.add(s)
    steps, finished = run(sched, PagedKVRunner(64, 16))
    first_seen = []
    for step in steps:
        assert len(step) <= 2
        first_seen += [sid for sid, *_ in step if sid not in first_seen]
    assert first_seen == [0, 1, 2, 3, 4]
    assert [s.seq_id for s in finished] == [0, 1, 2, 3, 4]


def test_schedule_is_deterministic():
    def once():
        sched = make_scheduler(num_blocks=8, budget=48, max_seqs=4)
        for sid, p, mt in WORKLOAD:
            sched.add(make_seq(sid, p, max_tokens=mt))
        return run(sched, PagedKVRunner(8, 16))[0]

    assert once() == once()


# ---- prefix caching ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "second_len, expected_cached",
    [(50, 48), (49, 48), (48, 32), (47, 32), (16, 0), (17, 16)],
)
def test_prefix_cache_hit_after_first_request_finished(second_len, expected_cached):
    sched = make_scheduler()
    base = prompt(3, 60)
    first = make_seq(0, base[:50], max_tokens=2)
    sched.add(first)
    run(sched, PagedKVRunner(64, 16))
    second = make_seq(1, base[:second_len], max_tokens=2)
    sched.add(second)
    out = sched.schedule()
    assert second.num_cached_tokens == expected_cached
    assert [(s.start, s.num_new_tokens, s.sample) for s in out.scheduled] == [
        (expected_cached, second_len - expected_cached, True)
    ]


def test_prefix_cache_hit_shares_live_blocks_and_keeps_outputs():
    runner = PagedKVRunner(64, 16)
    sched = make_scheduler()
    shared = prompt(5, 48)
    a = make_seq(0, shared + [1, 2], max_tokens=10)
    sched.add(a)
    for _ in range(2):
        sched.update(out := sched.schedule(), runner.execute(out))
    b = make_seq(1, shared + [3, 4, 5], max_tokens=4)
    sched.add(b)
    out = sched.schedule()
    assert b.num_cached_tokens == 48 and b.block_table[:3] == a.block_table[:3]
    assert all(sched.block_manager.ref_count(blk) == 2 for blk in a.block_table[:3])
    sched.update(out, runner.execute(out))
    run(sched, runner)
    ref = reference_outputs([(0, shared + [1, 2], 10), (1, shared + [3, 4, 5], 4)])
    assert (a.output_token_ids, b.output_token_ids) == (ref[0], ref[1])


def test_preempted_sequence_gets_prefix_hits_on_readmission():
    sched = make_scheduler(num_blocks=5, block_size=4, budget=64, max_seqs=4)
    old, new = make_seq(0, prompt(0, 8), max_tokens=6), make_seq(1, prompt(1, 8), max_tokens=4)
    sched.add(old)
    sched.add(new)
    runner = PagedKVRunner(5, 4)
    while new.num_preemptions == 0:
        sched.update(out := sched.schedule(), runner.execute(out))
    while new.status != SequenceStatus.RUNNING:
        sched.update(out := sched.schedule(), runner.execute(out))
    assert new.num_cached_tokens > 0, "its freed full blocks were still cached"
    run(sched, runner)
    ref = reference_outputs([(0, prompt(0, 8), 6), (1, prompt(1, 8), 4)])
    assert (old.output_token_ids, new.output_token_ids) == (ref[0], ref[1])


# ---- add() validation --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prompt_len, max_tokens, num_blocks, max_model_len, error",
    [
        (0, 4, 8, 512, "prompt is empty"),
        (512, 4, 64, 512, "max_model_len=512"),
        (100, 30, 8, 512, r"needs 129 KV slots but the cache holds 128 \(8 blocks of 16\)"),
        (100, None, 8, 512, "needs 511 KV slots"),
    ],
)
def test_add_rejects_requests_that_can_never_run(prompt_len, max_tokens, num_blocks, max_model_len, error):
    sched = make_scheduler(num_blocks=num_blocks, max_model_len=max_model_len)
    with pytest.raises(ValueError, match=error):
        sched.add(make_seq(0, prompt(0, prompt_len), max_tokens=max_tokens))
    assert not sched.has_unfinished()


@pytest.mark.parametrize("prompt_len, max_tokens", [(100, 29), (128, 1), (1, 128)])
def test_add_accepts_a_request_that_exactly_fills_the_cache(prompt_len, max_tokens):
    sched = make_scheduler(num_blocks=8)
    seq = make_seq(0, prompt(0, prompt_len), max_tokens=max_tokens)
    sched.add(seq)
    run(sched, PagedKVRunner(8, 16))
    assert seq.num_output_tokens == max_tokens


def test_add_rejects_duplicates_and_out_of_order_arrivals():
    sched = make_scheduler()
    sched.add(make_seq(5, prompt(0, 3)))
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add(make_seq(5, prompt(0, 3)))
    with pytest.raises(ValueError, match="FCFS order"):
        sched.add(make_seq(4, prompt(0, 3)))


def test_scheduler_rejects_unresolved_cache_size():
    with pytest.raises(ValueError, match="num_blocks"):
        Scheduler(SchedulerConfig(), CacheConfig(num_blocks=None))
    with pytest.raises(ValueError, match="does not match"):
        Scheduler(SchedulerConfig(), CacheConfig(num_blocks=4), BlockManager(5, 16))
