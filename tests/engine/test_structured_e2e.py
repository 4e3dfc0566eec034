"""Structured output end to end through LLM.generate with a tiny random-weight model at temperature 1.0."""

from __future__ import annotations

import pytest
from deepinfer.engine import LLM, SamplingParams

from tests.support.check import output_satisfies
from tests.support.spec_catalog import ALL_CASES, REJECTED_CASES, case_params_kwargs

SEEDS = (0,)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=str(tiny_checkpoint("llama")), device="cpu", cpu_kv_cache_gib=0.25)


@pytest.fixture(scope="module")
def table_outputs(llm):
    cases = [c for c in ALL_CASES for _ in SEEDS]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=c.max_tokens, **case_params_kwargs(c))
              for c in ALL_CASES for s in SEEDS]
    return cases, params, llm.generate(["Answer: "] * len(params), params, use_tqdm=False)


def test_finished_outputs_are_valid_and_nearly_all_finish(table_outputs):
    cases, params, outs = table_outputs
    for case, p, out in zip(cases, params, outs, strict=True):
        if out.finish_reason == "stop":
            assert output_satisfies(case.kind, case.spec, out.text), (case.name, out.text)
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == p.max_tokens
    finished = sum(o.finish_reason == "stop" for o in outs) / len(outs)
    assert finished >= 0.9, finished


def test_constrained_output_is_the_same_alone_and_in_a_batch(llm, table_outputs):
    cases, params, outs = table_outputs
    i = next(k for k, c in enumerate(cases) if c.name == "array_of_enums")
    alone = llm.generate(["Answer: "], params[i], use_tqdm=False)[0]
    assert alone.token_ids == outs[i].token_ids


@pytest.mark.parametrize("case", REJECTED_CASES[:4] + REJECTED_CASES[-3:], ids=lambda c: c.name)
def test_bad_constraint_is_refused_before_generation(llm, case):
    params = [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, **case_params_kwargs(case))]
    with pytest.raises(ValueError, match=case.kind):
        llm.generate(["a", "b"], params, use_tqdm=False)
    # The engine is still usable afterwards.
    assert len(llm.generate(["a"], SamplingParams(max_tokens=2), use_tqdm=False)[0].token_ids) == 2
