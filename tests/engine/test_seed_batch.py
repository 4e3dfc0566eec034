"""`request_seeds` (engine/sample/seed_batch.py) gives every request exactly `rng.request_seed`'s seed: the
stable contract of unseeded outputs, computed for a whole generate call in one vectorised pass."""

from __future__ import annotations

import random

import pytest
from deepinfer.engine.sample.params import SamplingParams
from deepinfer.engine.sample.rng import request_seed
from deepinfer.engine.sample.seed_batch import request_seeds

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
WARM = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=4)
SEEDED = SamplingParams(temperature=1.0, seed=1234)

EVERY_WIDTH = [10**k for k in range(18)] + [10**k - 1 for k in range(1, 19)] + [0, 5, 151935]
CASES = {
    "one id": [[7]],
    "every digit count": [EVERY_WIDTH, EVERY_WIDTH[::-1]],
    "ragged": [[1, 2, 3], [151_000] * 9, [42], list(range(0, 1000, 7))],
    "random vocab": [[random.Random(i).randrange(151_936) for _ in range(1 + 37 * i)] for i in range(12)],
    "bool ids (contract: T/F)": [[1, 2], [True, 3], [4]],
    "beyond 18 digits": [[1, 2], [10**18, 5]],
    "beyond int64": [[2**64 + 1]],
    "negative id": [[3, -1], [2]],
    "empty prompt": [[1], []],
    "tuple prompt": [(5, 6, 7), [8]],
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("engine_seed", [0, 2**63 - 1, -5])
def test_batch_seeds_are_request_seed(name, engine_seed):
    prompts = CASES[name]
    params = [(GREEDY, WARM, SEEDED)[i % 3] for i in range(len(prompts))]
    assert request_seeds(engine_seed, prompts, params) == [
        request_seed(engine_seed, p, sp) for p, sp in zip(prompts, params)]


def test_equal_params_given_as_distinct_objects_give_the_same_seeds():
    prompts = CASES["random vocab"]
    shared = request_seeds(3, prompts, [WARM] * len(prompts))
    copies = request_seeds(3, prompts, [SamplingParams(temperature=0.7, top_p=0.9, max_tokens=9)
                                        for _ in prompts])
    assert shared == copies   # max_tokens is not part of the distribution


@pytest.mark.parametrize("params", [[], [GREEDY]])
def test_counts_must_match(params):
    with pytest.raises(ValueError, match="prompts but"):
        request_seeds(0, [[1], [2]], params)


def test_all_seeded_needs_no_encoding():
    assert request_seeds(0, [[1], ["not an id"]], [SEEDED, SEEDED]) == [1234, 1234]


@pytest.mark.parametrize("prompts", [[[1, 2], [3, 4]], [[1, 2], [True, 4]]])   # vectorised and fallback paths
def test_a_parameter_no_seed_can_come_from_names_its_prompt(prompts):
    # SamplingParams refuses inf when built; one forced past the frozen dataclass still gets an error naming
    # its prompt, never a seed.
    bad = SamplingParams()
    object.__setattr__(bad, "temperature", float("inf"))
    with pytest.raises(ValueError, match=r"prompt 1: SamplingParams.temperature=inf cannot be fingerprinted"):
        request_seeds(0, prompts, [GREEDY, bad])
