"""The finish rules (engine/core/finish.py), applied by Scheduler.update: token rules, stop strings and
completed grammars, their precedence, the order finished requests release their blocks, and the grammar
state's lifetime through LLM.generate (built only for constrained requests, dropped on finish and abort)."""

from __future__ import annotations

import pytest
from deepinfer.engine import LLM
from deepinfer.engine.core.finish import FinishRules
from deepinfer.engine.core.sequence import Sequence, SequenceStatus
from deepinfer.engine.sample.params import SamplingParams

from tests.support.scheduler_harness import (
    PagedKVRunner,
    ScriptedRunner,
    make_scheduler,
    make_seq,
    prompt,
    run,
)

# ---- token rules ---------------------------------------------------------------------------------
EOS = frozenset({99})


@pytest.mark.parametrize(
    "script, params, max_model_len, expected_tokens, expected_reason",
    [
        ([11, 12, 99, 13], {"max_tokens": 10}, 512, [11, 12, 99], "stop"),
        ([11, 99, 13, 14], {"max_tokens": 3, "ignore_eos": True}, 512, [11, 99, 13], "length"),
        ([99, 12, 99, 99], {"max_tokens": 10, "min_tokens": 2}, 512, [99, 12, 99], "stop"),
        ([11, 42, 13], {"max_tokens": 10, "stop_token_ids": [42]}, 512, [11, 42], "stop"),
        ([11, 42, 13], {"max_tokens": 10, "stop_token_ids": [42], "ignore_eos": True}, 512, [11, 42], "stop"),
        ([42, 42, 42], {"max_tokens": 10, "stop_token_ids": [42], "min_tokens": 1}, 512, [42, 42], "stop"),
        ([11, 12, 13, 14], {"max_tokens": 3}, 512, [11, 12, 13], "length"),
        ([11, 12, 99], {"max_tokens": 3}, 512, [11, 12, 99], "stop"),    # stop wins over length
        ([11, 12, 13, 14, 15], {"max_tokens": None}, 8, [11, 12, 13], "length"),   # 5 + 3 = max_model_len
        ([11, 12, 13, 14, 15], {"max_tokens": 10}, 7, [11, 12], "length"),
    ],
)
def test_token_finish_reasons(script, params, max_model_len, expected_tokens, expected_reason):
    sched = make_scheduler(max_model_len=max_model_len)
    seq = make_seq(0, prompt(0, 5), eos=EOS, **params)
    sched.add(seq)
    _, finished = run(sched, ScriptedRunner({0: script}))
    assert finished == [seq] and seq.status == SequenceStatus.FINISHED
    assert (seq.output_token_ids, seq.finish_reason) == (expected_tokens, expected_reason)
    assert seq.logprobs == [{t: -0.5 * i} for i, t in enumerate(expected_tokens)]


@pytest.mark.parametrize("state", ["waiting", "running"])
def test_finish_from_outside_frees_blocks(state):
    sched = make_scheduler()
    seq = make_seq(0, prompt(0, 20), max_tokens=10)
    sched.add(seq)
    if state == "running":
        out = sched.schedule()
        sched.update(out, PagedKVRunner(64, 16).execute(out))
        assert seq.block_table
    sched.finish(seq, "stop")
    sched.finish(seq, "stop")   # idempotent
    assert seq.finish_reason == "stop" and seq.block_table == [] and not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 64
    assert sched.schedule().is_empty


def test_finish_between_schedule_and_update_is_skipped():
    sched = make_scheduler()
    a, b = make_seq(0, prompt(0, 5)), make_seq(1, prompt(1, 5))
    sched.add(a)
    sched.add(b)
    runner = PagedKVRunner(64, 16)
    out = sched.schedule()
    runner_out = runner.execute(out)
    sched.finish(a, "stop")   # e.g. aborted while the step ran
    sched.update(out, runner_out)
    assert a.output_token_ids == [] and b.num_output_tokens == 1
    run(sched, runner)


# ---- text rules ----------------------------------------------------------------------------------
class StopAt:
    """Detokenizer stand-in: matches a stop string when fed `token`; records every token it was fed."""

    def __init__(self, token: int) -> None:
        self.token, self.fed, self.stopped = token, [], False

    def add_token(self, token_id: int) -> str:
        self.fed.append(token_id)
        self.stopped = self.stopped or token_id == self.token
        return ""


class GrammarDoneAt:
    """Structured-output stand-in: a request's grammar is complete once `token` is sampled."""

    def __init__(self, token: int) -> None:
        self.token, self.fed = token, []

    def advance(self, seq: Sequence, token_id: int) -> bool:
        self.fed.append(token_id)
        return token_id == self.token


def _finish_alone(seq: Sequence, script: list[int], grammar: GrammarDoneAt | None = None) -> Sequence:
    sched = make_scheduler(finish_rules=FinishRules(512, grammar) if grammar is not None else None)
    sched.add(seq)
    _, finished = run(sched, ScriptedRunner({seq.seq_id: script}))
    assert finished == [seq] and seq.status == SequenceStatus.FINISHED
    return seq


@pytest.mark.parametrize("max_tokens", [2, 10])
def test_a_stop_string_stops_even_on_the_last_allowed_token(max_tokens):
    seq = make_seq(0, prompt(0, 5), max_tokens=max_tokens)
    seq.detokenizer = StopAt(42)
    _finish_alone(seq, [11, 42, 13])
    assert (seq.output_token_ids, seq.finish_reason) == ([11, 42], "stop")
    assert seq.detokenizer.fed == [11, 42]


@pytest.mark.parametrize("max_tokens", [2, 10])
def test_a_completed_grammar_stops_even_on_the_last_allowed_token(max_tokens):
    seq = make_seq(0, prompt(0, 5), max_tokens=max_tokens)
    seq.detokenizer = StopAt(-1)
    grammar = GrammarDoneAt(50)
    _finish_alone(seq, [11, 50, 12], grammar)
    assert (seq.output_token_ids, seq.finish_reason) == ([11, 50], "stop")
    assert grammar.fed == seq.detokenizer.fed == [11, 50]   # both see every token, the last one included


def test_text_rules_do_not_wait_for_min_tokens():
    seq = make_seq(0, prompt(0, 5), max_tokens=10, min_tokens=3)
    seq.detokenizer = StopAt(11)
    assert _finish_alone(seq, [11, 12, 13, 14]).output_token_ids == [11]
    seq = make_seq(1, prompt(1, 5), max_tokens=10, min_tokens=3)
    assert _finish_alone(seq, [11, 12, 13, 14], GrammarDoneAt(11)).output_token_ids == [11]


def test_text_only_finishes_release_their_blocks_after_token_rule_finishes():
    sched = make_scheduler(prefix=False)
    by_text, by_length = make_seq(0, prompt(0, 5), max_tokens=10), make_seq(1, prompt(1, 5), max_tokens=1)
    by_text.detokenizer = StopAt(20)
    sched.add(by_text)
    sched.add(by_length)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [by_text, by_length]
    blocks = by_text.block_table + by_length.block_table
    finished = sched.update(out, ScriptedRunner({0: [20], 1: [30]}).execute(out))
    assert finished == [by_length, by_text]
    assert (by_text.finish_reason, by_length.finish_reason) == ("stop", "length")
    # Freed blocks join the plain free list in release order: the token-rule finish first.
    assert list(sched.block_manager._free_plain)[-2:] == [blocks[1], blocks[0]]


# ---- grammar state through LLM.generate ------------------------------------------------------------
CHOICE = ["alpha beta gamma", "delta epsilon zeta"]


@pytest.fixture
def llm(tiny_checkpoint):
    return LLM(model=str(tiny_checkpoint("llama")), device="cpu", cpu_kv_cache_gib=0.25)


def test_unconstrained_requests_never_build_the_structured_manager(llm):
    llm.generate(["a", "b"], [SamplingParams(max_tokens=3), SamplingParams(max_tokens=3, stop=["x"])],
                 use_tqdm=False)
    assert llm._structured._manager is None
    out = llm.generate(["a"], SamplingParams(max_tokens=32, choice=CHOICE), use_tqdm=False)[0]
    assert llm._structured._manager is not None
    assert out.finish_reason == "stop" and out.text in CHOICE


def test_finish_and_abort_drop_grammar_and_detokenizer(llm, monkeypatch):
    seqs: list[Sequence] = []
    add = llm.engine.add

    def record(seq: Sequence) -> None:
        seqs.append(seq)
        add(seq)

    monkeypatch.setattr(llm.engine, "add", record)

    def fail(seq, prompt):
        assert seq.grammar is None   # dropped as soon as the request finished
        raise RuntimeError("consumer failed")

    monkeypatch.setattr(llm.engine.outputs, "build_output", fail)
    params = [SamplingParams(max_tokens=1, choice=CHOICE),
              SamplingParams(max_tokens=32, choice=CHOICE, stop=["zz"])]
    with pytest.raises(RuntimeError, match="consumer failed"):
        llm.generate(["a", "b"], params, use_tqdm=False)
    assert [s.finish_reason for s in seqs] == ["length", "abort"]
    assert all(s.grammar is None and s.detokenizer is None for s in seqs)
    monkeypatch.undo()
    assert llm.generate(["a"], SamplingParams(max_tokens=32, choice=CHOICE), use_tqdm=False)[0].text in CHOICE


def test_a_finished_request_holds_no_penalty_table(llm, monkeypatch):
    seqs: list[Sequence] = []
    add = llm.engine.add
    monkeypatch.setattr(llm.engine, "add", lambda seq: (seqs.append(seq), add(seq))[1])
    built: list[bool] = []
    build = llm.engine.outputs.build_output

    def check(seq, prompt):
        built.append(seq.penalty_tokens is None)   # dropped as soon as the request finished
        return build(seq, prompt)

    monkeypatch.setattr(llm.engine.outputs, "build_output", check)
    params = SamplingParams(max_tokens=6, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.4)
    outs = llm.generate(["a b", "c d e", "f"], params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [6, 6, 6]
    assert built == [True] * 3 and all(s.penalty_tokens is None for s in seqs)
