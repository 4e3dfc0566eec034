"""Requests reach the engine as its scheduler needs them (engine/core/request_feed.py): the first step
starts after its own requests are built, not all of them, and the schedule, the outputs and the errors are
those of queueing every request before the first step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.core.request_feed import QUEUE_ALL_ENV, RequestFeed

from tests.support.scheduler_harness import PagedKVRunner, make_scheduler, make_seq, prompt, run

# (prompt length, max_tokens) per request: long and short prompts, so token budgets and slot limits both bind.
SHAPES = [(5, 12), (40, 6), (70, 9), (3, 20), (33, 4), (16, 10), (90, 5), (1, 7), (48, 8), (20, 15),
          (64, 3), (7, 9), (25, 6), (2, 11), (55, 4), (30, 8)]


def workload(shared_prefix: int = 0) -> list[tuple[int, list[int], int]]:
    head = prompt(99, shared_prefix)
    return [(i, head + prompt(i, n), mt) for i, (n, mt) in enumerate(SHAPES)]


def feed_of(specs: list[tuple[int, list[int], int]], chunk: int) -> RequestFeed:
    return RequestFeed(lambda first, stop: [[make_seq(*specs[i][:2], max_tokens=specs[i][2])]
                                            for i in range(first, stop)], len(specs), chunk)


@pytest.mark.parametrize(
    "num_blocks, block_size, budget, max_seqs, chunked, prefix",
    [
        (64, 16, 512, 16, True, True),    # roomy: the slot count binds
        (64, 16, 32, 16, True, True),     # tight token budget: chunked prefills mixed with decodes
        (64, 16, 7, 16, True, False),     # budget below a block
        (64, 16, 512, 2, True, True),     # max_num_seqs caps the batch
        (8, 16, 64, 8, True, True),       # tiny cache: preemption by recompute
        (30, 4, 24, 4, True, True),       # small blocks, everything tight
        (64, 16, 512, 8, False, True),    # no chunked prefill
    ],
)
@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_a_fed_run_schedules_every_step_as_with_every_request_queued(
        num_blocks, block_size, budget, max_seqs, chunked, prefix, chunk):
    specs = workload()
    max_model_len = 512 if chunked else budget
    args = (num_blocks, block_size, budget, max_seqs, max_model_len, chunked, prefix)
    queued = make_scheduler(*args)
    seqs = [make_seq(sid, p, max_tokens=mt) for sid, p, mt in specs]
    for s in seqs:
        queued.add(s)
    want_steps, _ = run(queued, PagedKVRunner(num_blocks, block_size))
    fed = make_scheduler(*args)
    feed = feed_of(specs, chunk)
    got_steps, finished = run(fed, PagedKVRunner(num_blocks, block_size), feed=feed)
    assert got_steps == want_steps
    assert sorted(s.seq_id for s in finished) == list(range(len(specs)))
    assert {s.seq_id: s.output_token_ids for s in finished} == {s.seq_id: s.output_token_ids for s in seqs}


@pytest.mark.parametrize("budget", [16, 96, 512])
def test_requests_served_from_the_prefix_cache_are_counted_at_their_uncached_cost(budget):
    # Shared 48-token heads: once the first request has registered them, every later one computes only its
    # own tail, so a step admits more requests than its budget would cover at their full length; the feed
    # must queue that many.
    specs = workload(shared_prefix=48)
    queued = make_scheduler(64, 16, budget, 16, 512, True, True)
    seqs = [make_seq(sid, p, max_tokens=mt) for sid, p, mt in specs]
    for s in seqs:
        queued.add(s)
    want_steps, _ = run(queued, PagedKVRunner(64, 16))
    got_steps, finished = run(make_scheduler(64, 16, budget, 16, 512, True, True), PagedKVRunner(64, 16),
                              feed=feed_of(specs, 1))
    assert got_steps == want_steps
    assert sum(s.num_cached_tokens > 0 for s in finished) >= len(specs) // 2, "the workload hits the cache"
    assert {s.seq_id: s.output_token_ids for s in finished} == {s.seq_id: s.output_token_ids for s in seqs}


@pytest.mark.parametrize(
    "budget, max_seqs, running, chunk, added",
    [
        (64, 8, 0, 1, 4),      # 4 x 20 tokens >= 64: a step's budget stops it
        (64, 8, 0, 3, 6),      # whole chunks: the chunk that crossed the line is kept
        (512, 3, 0, 1, 3),     # three free slots: three requests, whatever their tokens
        (512, 3, 3, 1, 0),     # no free slot: nothing is built
        (512, 30, 0, 5, 16),   # 16 x 20 tokens < 512: every request
    ],
)
def test_top_up_builds_what_the_next_step_could_admit_and_no_more(budget, max_seqs, running, chunk, added):
    sched = make_scheduler(num_blocks=512, budget=budget, max_seqs=max_seqs)
    for i in range(running):   # running sequences only take slots
        seq = make_seq(1000 + i, prompt(i, 4))
        sched.running.append(seq)
    specs = [(i, prompt(i, 20), 4) for i in range(16)]
    feed = feed_of(specs, chunk)
    feed.top_up(SimpleNamespace(scheduler=sched, add=sched.add))
    assert feed.added == added == len(sched.waiting)
    assert feed.exhausted == (added == len(specs))


def test_top_up_does_nothing_once_every_request_is_added():
    sched = make_scheduler()
    feed = feed_of([(0, prompt(0, 5), 2)], 4)
    core = SimpleNamespace(scheduler=sched, add=sched.add)
    feed.top_up(core)
    feed.top_up(core)
    assert feed.exhausted and len(sched.waiting) == 1


def test_a_feed_refuses_a_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk=0"):
        RequestFeed(lambda first, stop: [], 3, chunk=0)


# ---- LLM.generate ------------------------------------------------------------------------------
def _llm(model_dir: str) -> LLM:
    return LLM(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=256,
               max_num_batched_tokens=64, max_num_seqs=8)


def _run(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, [list(d.items()) for d in c.logprobs or []], c.text, c.seed) for c in o.outputs]
            for o in outs]


def test_generate_starts_with_its_first_steps_requests_and_gives_the_queued_outputs(model_dir, monkeypatch):
    prompts = [[(7 * i + j) % 300 + 3 for j in range(5 + (i * 11) % 40)] for i in range(30)]
    params = [SamplingParams(max_tokens=6, temperature=0.8 if i % 3 else 0.0, logprobs=2,
                             n=2 if i % 7 == 0 else 1, ignore_eos=True) for i in range(30)]
    llm = _llm(model_dir)
    sched = llm.engine.scheduler
    known_at_first_step: list[int] = []
    schedule = sched.schedule

    def first_watch():
        if not known_at_first_step:
            known_at_first_step.append(len(sched.waiting) + len(sched.running))
        return schedule()

    monkeypatch.setattr(sched, "schedule", first_watch)
    fed = _run(llm, prompts, params)
    assert 0 < known_at_first_step[0] < sum(p.n for p in params)
    # The A/B switch: everything built before the first step (one chunk of every request).
    known_at_first_step.clear()
    monkeypatch.setattr(sched, "schedule", first_watch)
    monkeypatch.setenv(QUEUE_ALL_ENV, "1")
    assert _run(llm, prompts, params) == fed
    assert known_at_first_step == [sum(p.n for p in params)]


def test_a_request_the_cache_cannot_hold_is_refused_before_any_step(model_dir):
    llm = LLM(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=4, max_model_len=512,
              max_num_batched_tokens=64, max_num_seqs=8)
    prompts = [[5, 6, 7]] * 20 + [[5, 6, 8]]
    params = [SamplingParams(max_tokens=8)] * 20 + [SamplingParams(max_tokens=400)]
    steps = llm.get_stats()["overlap_steps"]
    with pytest.raises(ValueError, match=r"prompt 20: prompt of 3 tokens \+ up to 400 output tokens"):
        llm.generate(prompts, params, use_tqdm=False)
    assert llm.get_stats()["overlap_steps"] == steps
    outs = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 3
