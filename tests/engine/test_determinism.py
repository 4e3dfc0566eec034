"""A seeded request's tokens depend only on its prompt, parameters and seed — never on the batch."""

from __future__ import annotations

import random

import pytest
from deepinfer.engine import LLM, SamplingParams


def _requests(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(7)
    long_prefix = [rng.randrange(10, vocab) for _ in range(40)]
    prompts, params = [], []
    for i in range(48):
        body = [rng.randrange(10, vocab) for _ in range(rng.randint(2, 50))]
        prompts.append(long_prefix + body if i % 3 == 0 else body)
        params.append(SamplingParams(
            temperature=0.9, top_p=rng.choice([1.0, 0.9, 0.7]), top_k=rng.choice([-1, 20, 50]),
            min_p=rng.choice([0.0, 0.05]), seed=1000 + i, max_tokens=rng.randint(8, 24), ignore_eos=True,
        ))
    return prompts, params


def _run(llm: LLM, prompts, params, order) -> dict[int, list[int]]:
    outs = llm.generate([prompts[i] for i in order], [params[i] for i in order], use_tqdm=False)
    return {i: o.token_ids for i, o in zip(order, outs)}


SETTINGS = {
    "together": dict(num_kv_blocks=1024),
    "budget_5seqs_no_prefix_cache": dict(num_kv_blocks=1024, max_num_seqs=5, max_num_batched_tokens=19,
                                         enable_prefix_caching=False),
    "preemption": dict(num_kv_blocks=20, max_num_seqs=48),
}


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=1024)
    prompts, params = _requests(llm.model_config.vocab_size)
    return llm, prompts, params, _run(llm, prompts, params, list(range(48)))


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_batch_composition_does_not_change_tokens(setting, model_dir, reference):
    _, prompts, params, ref = reference
    llm = LLM(model=model_dir, device="cpu", dtype="float32", **SETTINGS[setting])
    order = list(range(48))
    random.Random(setting).shuffle(order)
    got = _run(llm, prompts, params, order)
    assert got == ref
    if setting == "preemption":
        stats = llm.generate(prompts, params, use_tqdm=False)
        assert sum(o.metrics["num_preemptions"] for o in stats) > 0, "the setting must force preemption"


def test_one_at_a_time_equals_together(reference):
    llm, prompts, params, ref = reference
    for i in range(0, 48, 5):
        assert _run(llm, prompts, params, [i]) == {i: ref[i]}


def test_unseeded_requests_derive_seed_from_content_not_arrival(model_dir):
    llm = LLM(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=256)
    p = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    a = llm.generate([[11, 12, 13], [21, 22, 23, 24]], p, use_tqdm=False)
    b = llm.generate([[21, 22, 23, 24], [11, 12, 13]], p, use_tqdm=False)
    assert a[0].token_ids == b[1].token_ids and a[1].token_ids == b[0].token_ids
    assert a[0].seed == b[1].seed


def test_fast_mode_still_generates(model_dir):
    llm = LLM(model=model_dir, device="cpu", dtype="float32", deterministic=False, num_kv_blocks=256)
    outs = llm.generate([[5, 6, 7]] * 3, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o.token_ids) == 8 for o in outs)
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
