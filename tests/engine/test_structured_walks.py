"""Random-walk generation over the whole constraint table: every finished output is valid, and budget
steering makes nearly all of them finish within max_tokens."""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine import SamplingParams
from deepinfer.engine.structured.manager import StructuredOutputManager
from tokenizers import Tokenizer

from tests.support.check import output_satisfies
from tests.support.random_walk import random_walks
from tests.support.spec_catalog import ALL_CASES, case_params_kwargs
from tests.support.structured_demo import EOS_IDS, demo_tokenizer

WALKS = 6


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # The walks are many tiny torch ops; on a busy 2-core runner, OpenMP spinning next to the grammar
    # worker thread makes them ~10x slower. Restored afterwards.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path, size = demo_tokenizer(tmp_path_factory.mktemp("walk_tok"))
    return path, Tokenizer.from_file(str(path)), size + 64


def _walk_table(setup, steering: bool) -> dict[str, list]:
    path, tok, vocab = setup
    manager = StructuredOutputManager(path, vocab, EOS_IDS, max_threads=1, steering=steering)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
    # All cases in one batch, as an engine step would hold them.
    params = [SamplingParams(max_tokens=c.max_tokens, **case_params_kwargs(c)) for c in ALL_CASES
              for _ in range(WALKS)]
    results = random_walks(manager, params, decode, seed=7)
    manager.close()
    return {c.name: results[i * WALKS:(i + 1) * WALKS] for i, c in enumerate(ALL_CASES)}


@pytest.fixture(scope="module")
def steered(setup):
    return _walk_table(setup, steering=True)


@pytest.fixture(scope="module")
def unsteered(setup):
    return _walk_table(setup, steering=False)


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_every_finished_output_is_valid(steered, unsteered, case):
    for results in (steered[case.name], unsteered[case.name]):
        for r in results:
            if r.finish_reason == "stop":
                assert output_satisfies(case.kind, case.spec, r.text), r.text
            else:
                assert r.finish_reason == "length" and len(r.token_ids) == case.max_tokens


def test_nearly_all_walks_finish_within_budget_with_steering(steered, unsteered):
    def rate(table):
        results = [r for rs in table.values() for r in rs]
        return sum(r.finish_reason == "stop" for r in results) / len(results)

    # Measured on this table (6 walks per case): ~92% without steering, ~98% with it.
    assert rate(steered) >= 0.95
    assert rate(steered) > rate(unsteered)


def test_walk_does_not_depend_on_the_rest_of_the_batch(setup):
    path, tok, vocab = setup
    manager = StructuredOutputManager(path, vocab, EOS_IDS, max_threads=2)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
    target = SamplingParams(max_tokens=64, **case_params_kwargs(ALL_CASES[0]))
    others = [SamplingParams(max_tokens=c.max_tokens, **case_params_kwargs(c)) for c in ALL_CASES[1:6]]
    alone = random_walks(manager, [target], decode, seed=3)[0]
    batched = random_walks(manager, [target, *others], decode, seed=3)[0]
    manager.close()
    assert alone.token_ids == batched.token_ids


def test_budget_exhausted_output_finishes_with_length(setup):
    path, tok, vocab = setup
    manager = StructuredOutputManager(path, vocab, EOS_IDS, max_threads=1)
    schema = {"type": "object", "properties": {"k": {"type": "string", "minLength": 20}}, "required": ["k"]}
    params = SamplingParams(max_tokens=3, json_schema=schema)
    result = random_walks(manager, [params], lambda ids: tok.decode(ids), seed=0)[0]
    manager.close()
    assert result.finish_reason == "length"
    assert not output_satisfies("json_schema", schema, result.text)
