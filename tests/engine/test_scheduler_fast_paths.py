"""The scheduler's batch fast paths equal its per-row paths: the decode fast path (core/scheduler_decode.py)
builds the step the general `schedule` builds, the batch update (core/scheduler_update.py) leaves the state
the per-row update leaves, and the batched finish-rule filters (core/finish.py) never miss a row the
per-row rules would end. Each comparison runs the same workload with the fast paths on and forced off."""

from __future__ import annotations

import random

import pytest
from deepinfer.engine import LLM
from deepinfer.engine.core import scheduler as scheduler_module
from deepinfer.engine.core import scheduler_update
from deepinfer.engine.core.finish import FinishRules, token_finish_reason, token_rule_filter, token_rule_rows
from deepinfer.engine.core.sequence import Sequence
from deepinfer.engine.sample.params import SamplingParams

from tests.engine.test_overlap import SETTINGS, _requests, _view
from tests.support.scheduler_harness import PagedKVRunner, make_scheduler, make_seq, prompt, run

EOS = frozenset({13, 40})


def _seq(i: int, n_prompt: int, outs: list[int], eos: frozenset[int] = EOS, **params) -> Sequence:
    s = Sequence(seq_id=i, prompt_token_ids=list(range(1, n_prompt + 1)), params=SamplingParams(**params),
                 seed=0, eos_token_ids=eos)
    s.output_token_ids = list(outs)
    return s


# (prompt length, outputs, params, max_model_len): every rule, each side of each threshold.
CASES = [
    (5, [7], {}, 64),
    (5, [13], {}, 64),                                       # EOS
    (5, [13], {"ignore_eos": True}, 64),
    (5, [13], {"min_tokens": 1}, 64),                        # EOS before min_tokens: no stop
    (5, [7, 13], {"min_tokens": 1}, 64),                     # ... and after it
    (5, [7, 42], {"stop_token_ids": [42]}, 64),
    (5, [42], {"stop_token_ids": [42], "ignore_eos": True, "min_tokens": 2}, 64),
    (5, [7, 8, 9], {"max_tokens": 3}, 64),
    (5, [7, 8], {"max_tokens": 3}, 64),
    (5, [7, 8], {"max_tokens": None}, 7),                    # max_model_len
    (5, [7], {"max_tokens": None}, 7),
    (60, [7, 8, 9, 10], {"max_tokens": 4, "stop_token_ids": [10]}, 64),
]


@pytest.mark.parametrize("shared", [True, False])
def test_batched_token_rules_keep_every_row_the_per_row_rules_end(shared):
    seqs = []
    for i, (n_prompt, outs, params, _) in enumerate(CASES):
        seqs.append(_seq(i, n_prompt, outs, **params))
    for mml in sorted({c[3] for c in CASES}):
        if shared:   # one params object per batch, the shape LLM.generate gives
            for i, case in enumerate(CASES):
                p = seqs[i].params
                batch = [_seq(j, c[0], c[1]) for j, c in enumerate(CASES)]
                for q in batch:
                    q.params = p
                rows = token_rule_rows(batch, mml)
                stop_ids, eos_stops, cap, _ = token_rule_filter(p, mml)
                last = [q.output_token_ids[-1] for q in batch]
                one_pass = [j for j, q in enumerate(batch) if (
                    last[j] in stop_ids or (eos_stops and last[j] in q.eos_token_ids)
                    or len(q.output_token_ids) >= cap or q.num_tokens >= mml)]
                ended = [j for j, q in enumerate(batch) if token_finish_reason(q, mml) is not None]
                assert set(ended) <= set(rows) and set(ended) <= set(one_pass), (case, mml)
        else:
            rows = token_rule_rows(seqs, mml)
            ended = [i for i, q in enumerate(seqs) if token_finish_reason(q, mml) is not None]
            assert set(ended) <= set(rows) and rows == sorted(rows), mml
            assert ended, "the table has rows that end"


def test_rows_to_check_adds_rows_with_text_or_grammar_state():
    seqs = [_seq(i, 5, [7]) for i in range(4)]
    seqs[2].detokenizer = object()
    rules = FinishRules(64)
    assert rules.rows_to_check(seqs) == [2]
    seqs[0].output_token_ids = [13]
    assert rules.rows_to_check(seqs) == [0, 2]


class _StopAt:
    """Detokenizer stand-in: its stop string matches once `token` is fed."""

    def __init__(self, token: int) -> None:
        self.token, self.stopped = token, False

    def add_token(self, token_id: int) -> str:
        self.stopped = self.stopped or token_id == self.token
        return ""


def _workload(seed: int, shared: bool) -> list[Sequence]:
    rng = random.Random(seed)
    shared_params = SamplingParams(max_tokens=rng.randint(5, 30), stop_token_ids=[rng.randrange(10, 60)])
    seqs = []
    for i in range(rng.randint(3, 12)):
        n = rng.randint(1, 40)
        p = prompt(i % 4 if rng.random() < 0.5 else 100 + i, n)   # shared prefixes: prefix-cache hits
        if shared:
            s = make_seq(i, p, eos=frozenset({rng.randrange(10, 60)}))
            s.params = shared_params
        else:
            s = make_seq(i, p, eos=frozenset({rng.randrange(10, 60)}), max_tokens=rng.randint(1, 30),
                         min_tokens=rng.choice([0, 2]), ignore_eos=rng.random() < 0.3,
                         stop_token_ids=[rng.randrange(10, 60)] if rng.random() < 0.5 else None)
        if rng.random() < 0.2:
            s.detokenizer = _StopAt(rng.randrange(10, 60))
        seqs.append(s)
    return seqs


def _run(seed: int, shared: bool, fast: bool, monkeypatch, cfg: dict) -> tuple:
    with monkeypatch.context() as m:
        taken = {"decode": 0, "batch": 0}
        decode_fast, batch_rows = scheduler_module.schedule_decodes, scheduler_update._batch_rows

        def decodes(sched):
            out = decode_fast(sched) if fast else None
            taken["decode"] += out is not None
            return out

        def rows(*a):
            got = batch_rows(*a) if fast else None
            taken["batch"] += got is not None
            return got

        m.setattr(scheduler_module, "schedule_decodes", decodes)
        m.setattr(scheduler_update, "_batch_rows", rows)
        sched = make_scheduler(**cfg)
        seqs = _workload(seed, shared)
        for s in seqs:
            sched.add(s)
        tables: list[list[list[int]]] = []
        runner = PagedKVRunner(cfg["num_blocks"], 16)
        execute = runner.execute

        def recording(out):
            tables.append([list(s.seq.block_table) for s in out.scheduled])
            return execute(out)

        runner.execute = recording
        steps, finished = run(sched, runner)
    view = [(s.output_token_ids, s.finish_reason, s.num_cached_tokens, s.num_preemptions) for s in seqs]
    return steps, tables, [s.seq_id for s in finished], view, taken


@pytest.mark.parametrize("cfg", [dict(num_blocks=64, max_seqs=8), dict(num_blocks=12, max_seqs=8),
                                 dict(num_blocks=64, max_seqs=4, budget=20, prefix=False)],
                         ids=["plain", "preemption", "chunked_no_prefix"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared_params", "mixed_params"])
@pytest.mark.parametrize("seed", range(4))
def test_fast_paths_leave_the_per_row_paths_state(seed, shared, cfg, monkeypatch):
    *slow, _ = _run(seed, shared, False, monkeypatch, cfg)
    *fast, taken = _run(seed, shared, True, monkeypatch, cfg)
    assert fast == slow
    assert taken["decode"] > 0 and taken["batch"] > 0, taken   # the fast paths did run


@pytest.mark.parametrize("setting", ["default", "preemption"])
def test_overlapped_loop_gives_the_same_outputs_without_the_fast_paths(setting, model_dir, monkeypatch):
    llm = LLM(model=model_dir, device="cpu", dtype="float32", async_scheduling=True, **SETTINGS[setting])
    prompts, params = _requests(llm.model_config.vocab_size)
    fast = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(scheduler_module, "schedule_decodes", lambda sched: None)
    monkeypatch.setattr(scheduler_update, "_batch_rows", lambda *a: None)
    slow = llm.generate(prompts, params, use_tqdm=False)
    assert _view(fast) == _view(slow)
