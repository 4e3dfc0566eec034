"""The overlapped loop (core/overlap.py) gives exactly the synchronous loop's outputs on CPU.

On CPU the device is synchronous, so overlap is only a reordering of host work: what these tests check is
its bookkeeping (optimistic scheduling, placeholder tokens, finished sequences dropped one step late,
preemption of a sequence whose token is in flight) under chunked prefill, preemption, prefix-cache hits,
grammars, stop strings, penalties, min_tokens and max_tokens=1.
"""

from __future__ import annotations

import random

import pytest
from deepinfer.engine import LLM, SamplingParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
          "required": ["a", "b"]}

SETTINGS = {
    "default": dict(num_kv_blocks=512),
    "chunked_prefill": dict(num_kv_blocks=512, max_num_batched_tokens=24, max_num_seqs=6),
    "preemption": dict(num_kv_blocks=14, max_num_seqs=32),
}


def _requests(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(11)
    prefix = [rng.randrange(10, vocab) for _ in range(40)]
    many_stops = list(range(10, vocab, 3))   # a third of the vocabulary: these requests stop early
    prompts, params = [], []
    for i in range(26):
        body = [rng.randrange(10, vocab) for _ in range(rng.randint(1, 30))]
        prompts.append(prefix + body if i % 3 == 0 else body)
        n = rng.randint(4, 20)
        seed = 500 + i
        kind = i % 9
        if kind == 0:
            sp = SamplingParams(temperature=0.0, max_tokens=n, logprobs=2)
        elif kind == 1:
            sp = SamplingParams(temperature=0.9, top_p=0.8, seed=seed, max_tokens=n, logprobs=3)
        elif kind == 2:
            sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=1)
        elif kind == 3:
            sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=n, min_tokens=3,
                                stop_token_ids=many_stops)
        elif kind == 4:
            sp = SamplingParams(temperature=0.8, seed=seed, max_tokens=n, repetition_penalty=1.3,
                                presence_penalty=0.5, frequency_penalty=0.2)
        elif kind == 5:
            sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=n, stop=["e", "a "])
        elif kind == 6:
            sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=24, json_schema=SCHEMA)
        elif kind == 7:
            sp = SamplingParams(temperature=1.0, seed=seed, max_tokens=8, choice=["yes", "no", "maybe"])
        else:
            sp = SamplingParams(temperature=1.2, top_k=5, seed=seed, max_tokens=n, logprobs=1)
        params.append(sp)
    return prompts, params


def _view(outs) -> list[tuple]:
    return [(o.token_ids, o.logprobs, o.text, o.finish_reason) for o in outs]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_overlap_gives_the_synchronous_outputs(setting, model_dir):
    llm = LLM(model=model_dir, device="cpu", dtype="float32", async_scheduling=False, **SETTINGS[setting])
    prompts, params = _requests(llm.model_config.vocab_size)
    sync = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.async_scheduling = True
    overlap = llm.generate(prompts, params, use_tqdm=False)
    assert _view(overlap) == _view(sync)
    stats = llm.get_stats()
    assert stats["overlapped_steps"] > 0 and stats["overlap_wasted_rows"] > 0, stats
    if setting == "preemption":
        assert any(o.metrics["num_preemptions"] for o in overlap)
    # Arrival order within a batch changes the schedule, never a request's output.
    order = list(reversed(range(len(prompts))))
    shuffled = llm.generate([prompts[i] for i in order], [params[i] for i in order], use_tqdm=False)
    assert _view(shuffled) == [_view(sync)[i] for i in order]


def test_max_tokens_one_wastes_nothing(model_dir):
    llm = LLM(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=64)
    outs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=1.0, seed=3, max_tokens=1),
                        use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [1, 1]
    stats = llm.get_stats()
    # One prefill step; its successor is known to be unneeded (max_tokens) and never scheduled.
    assert stats["overlap_steps"] == 1 and stats["overlap_wasted_rows"] == 0, stats


def test_sync_loop_switches(model_dir, monkeypatch):
    monkeypatch.setenv("DEEPINFER_SYNC_LOOP", "1")
    llm = LLM(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=64)
    assert not llm.engine.async_scheduling
    monkeypatch.delenv("DEEPINFER_SYNC_LOOP")
    assert LLM(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=64).engine.async_scheduling
    stats = llm.get_stats()
    # CUDA graphs are ignored on CPU.
    assert stats["cuda_graphs_enabled"] is False and stats["cuda_graph_buckets"] == []
    assert stats["spec_drafted_tokens"] == 0


def test_failure_mid_run_leaves_no_placeholder_and_a_usable_engine(model_dir, monkeypatch):
    llm = LLM(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=64)
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    want = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].token_ids
    calls = {"n": 0}
    sample = llm.engine.executor.sample

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return sample(*args, **kwargs)

    monkeypatch.setattr(llm.engine.executor, "sample", flaky)
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate([[5, 6, 7], [1, 2]], sp, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.scheduler.has_unfinished()
    assert llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].token_ids == want
