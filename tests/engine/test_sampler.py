"""Sampler: exact filtered-distribution sampling, batch invariance, penalties, greedy ties."""

from __future__ import annotations

import math

import pytest
import torch
from deepinfer.engine.sample import sampler as sampler_module
from deepinfer.engine.sample.metadata import SamplingMetadata
from deepinfer.engine.sample.params import SamplingParams as SP
from deepinfer.engine.sample.penalties import apply_penalties
from deepinfer.engine.sample.sampler import (
    first_k_mask,
    min_p_mask,
    top_k_top_p_mask,
)

from tests.support.sampler_harness import (
    EOS,
    _assert_rows_invariant,
    _mixed_batch,
    run,
)


@pytest.mark.parametrize("vocab,seed", [(37, 0), (37, 1), (301, 2), (1000, 3)])
def test_each_row_samples_the_same_alone_as_in_a_shuffled_mixed_batch(vocab, seed):
    _assert_rows_invariant(*_mixed_batch(vocab, seed))


def test_row_chunking_of_large_batches_changes_no_result(monkeypatch):
    rows, logits, args = _mixed_batch(301, 4)
    whole = run(logits, rows, **args)
    monkeypatch.setattr(sampler_module, "_CHUNK_ELEMENTS", 3 * 301)    # 3 rows per chunk
    chunked = run(logits, rows, **args)
    assert torch.equal(whole.token_ids, chunked.token_ids) and whole.logprobs == chunked.logprobs


@pytest.mark.parametrize("params", [SP(temperature=0.8), SP(top_p=0.5), SP(top_k=4), SP(temperature=0)])
def test_row_result_does_not_depend_on_which_other_rows_need_filters(params):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(1, 50, generator=gen)
    alone = run(logits, [params], seeds=[77], positions=[3]).token_ids.item()
    for others in ([SP(top_p=0.3)], [SP(top_k=2), SP(min_p=0.5)], [SP(temperature=0)],
                   [SP(repetition_penalty=2.0, min_tokens=3)]):
        batch = torch.cat([torch.randn(len(others), 50, generator=gen), logits])
        got = run(batch, others + [params], seeds=[1] * len(others) + [77],
                  positions=[0] * len(others) + [3], eos=[[EOS]] * (len(others) + 1))
        assert got.token_ids[-1].item() == alone


# ---------------------------------------------------------------------------------------------------------
# Seeds and positions

def test_same_seed_and_position_gives_same_token_other_positions_and_seeds_differ():
    vocab, n = 8, 4000
    logits = torch.zeros(n, vocab)   # uniform: every draw is pure noise
    a = run(logits, [SP()] * n, seeds=[5] * n, positions=list(range(n))).token_ids
    assert torch.equal(a, run(logits, [SP()] * n, seeds=[5] * n, positions=list(range(n))).token_ids)
    b = run(logits, [SP()] * n, seeds=[6] * n, positions=list(range(n))).token_ids
    assert (a == b).float().mean().item() < 0.2          # ~1/8 by chance
    # Consecutive positions are independent: the 64 (token_t, token_t+1) pairs are equally frequent.
    pairs = torch.bincount(a[:-1] * vocab + a[1:], minlength=vocab * vocab).double()
    expected = (n - 1) / (vocab * vocab)
    chi2 = ((pairs - expected) ** 2 / expected).sum().item()
    assert chi2 < 120, chi2                              # df = 63; p(chi2 > 120) ~ 1e-5


def test_greedy_rows_ignore_seed_and_position():
    logits = torch.tensor([[0.0, 2.0, 1.0]] * 3)
    out = run(logits, [SP(temperature=0)] * 3, seeds=[1, 2, 3], positions=[0, 9, 99])
    assert out.token_ids.tolist() == [1, 1, 1]


# ---------------------------------------------------------------------------------------------------------
# The sampled distribution is the filtered softmax

LOGITS8 = [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0]


def _reference(logits: list[float], p: SP) -> list[float]:
    """Independent float64 reference of temperature -> top-k -> top-p -> min-p, renormalised."""
    x = [v / p.temperature for v in logits]
    m = max(x)
    w = [math.exp(v - m) for v in x]
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    keep = set(order[: p.top_k] if p.top_k > 0 else order)
    total = sum(w[i] for i in keep)
    cum, nucleus = 0.0, set()
    for i in order:
        if i in keep and cum < p.top_p * total:
            assert abs(cum - p.top_p * total) > 1e-6 * total, "test case sits on a top-p boundary"
            nucleus.add(i)
            cum += w[i]
    keep = {i for i in nucleus if w[i] >= p.min_p * max(w)}
    z = sum(w[i] for i in keep)
    return [w[i] / z if i in keep else 0.0 for i in range(len(x))]


@pytest.mark.parametrize("params,wrong", [
    (SP(temperature=1.0), SP(temperature=0.7)),
    (SP(temperature=0.7), SP(temperature=1.0)),
    (SP(temperature=1.5, top_k=3), SP(temperature=1.5)),
    (SP(top_p=0.7), SP()),
    (SP(min_p=0.2), SP()),
    (SP(temperature=0.8, top_k=6, top_p=0.9, min_p=0.1), SP(temperature=0.8)),
])
def test_sampled_frequencies_match_the_filtered_softmax(params, wrong):
    n = 5000
    logits = torch.tensor([LOGITS8] * n)
    tokens = run(logits, [params] * n, seeds=[2024] * n, positions=list(range(n))).token_ids
    observed = torch.bincount(tokens, minlength=8).double()

    def chi2(p: SP) -> float:
        q = torch.tensor(_reference(LOGITS8, p), dtype=torch.float64)
        if (observed[q == 0] > 0).any():
            return math.inf
        e = q[q > 0] * n
        return ((observed[q > 0] - e) ** 2 / e).sum().item()

    assert chi2(params) < 30                 # df <= 7; p(chi2 > 30) < 1e-4
    assert chi2(wrong) > 60                  # the test can tell the wrong distribution apart


# ---------------------------------------------------------------------------------------------------------
# Filters exclude the right tokens

def _log(ps: list[float]) -> list[float]:
    return [math.log(p) for p in ps]


P4 = _log([0.15, 0.5, 0.05, 0.3])            # ranks: 1, 3, 0, 2


@pytest.mark.parametrize("x,k,expected", [
    ([1.0, 3.0, 3.0, 3.0, 0.0], 2, [0, 1, 1, 0, 0]),    # ties at the boundary: lowest ids win
    ([1.0, 3.0, 3.0, 3.0, 0.0], 4, [1, 1, 1, 1, 0]),
    ([1.0, 3.0, 3.0, 3.0, 0.0], 5, [1, 1, 1, 1, 1]),
    (P4, 1, [0, 1, 0, 0]),
    (P4, 3, [1, 1, 0, 1]),
])
def test_top_k_keeps_exactly_k_tokens(x, k, expected):
    got = first_k_mask(torch.tensor([x]), torch.tensor([k]), k)
    assert got.int().tolist() == [expected]


@pytest.mark.parametrize("x,k,top_p,expected", [
    (P4, 4, 0.75, [0, 1, 0, 1]),
    (P4, 4, 0.85, [1, 1, 0, 1]),
    (P4, 4, 0.01, [0, 1, 0, 0]),               # the top token is always kept
    (P4, 4, 1.0, [1, 1, 1, 1]),
    (P4, 2, 0.6, [0, 1, 0, 0]),                # top-p runs on the renormalised top-k: 0.5/0.8 >= 0.6
    (P4, 4, 0.6, [0, 1, 0, 1]),                # ... while without top-k 0.5 < 0.6 needs a second token
    ([0.0, 0.0, 0.0, 0.0], 4, 0.4, [1, 1, 0, 0]),   # equal masses: lowest ids first
    ([0.0, float("-inf"), 0.0, 0.0], 4, 1.0, [1, 0, 1, 1]),
])
def test_top_p_keeps_the_smallest_prefix_reaching_top_p(x, k, top_p, expected):
    got = top_k_top_p_mask(torch.tensor([x]), torch.tensor([k]), torch.tensor([top_p], dtype=torch.float64))
    assert got.int().tolist() == [expected]


@pytest.mark.parametrize("min_p,expected", [(0.35, [0, 1, 0, 1]), (0.2, [1, 1, 0, 1]), (1.0, [0, 1, 0, 0])])
def test_min_p_drops_tokens_below_min_p_times_the_top_probability(min_p, expected):
    got = min_p_mask(torch.tensor([P4]), torch.tensor([min_p]))
    assert got.int().tolist() == [expected]


@pytest.mark.parametrize("params,kept", [
    (SP(top_k=2), {1, 3}),
    (SP(top_p=0.75), {1, 3}),
    (SP(min_p=0.2), {0, 1, 3}),
    (SP(top_k=3, top_p=0.9, min_p=0.35), {1, 3}),
])
def test_sampler_draws_exactly_the_kept_tokens(params, kept):
    n = 2000
    tokens = run(torch.tensor([P4] * n), [params] * n, positions=list(range(n))).token_ids
    assert set(tokens.tolist()) == kept


# ---------------------------------------------------------------------------------------------------------
# Penalties, greedy, min_tokens

ROW = [2.0, -2.0, 1.0, -1.0, 0.5, 3.0]


@pytest.mark.parametrize("params,expected", [
    (SP(repetition_penalty=2.0), [1.0, -4.0, 0.5, -2.0, 0.5, 3.0]),    # prompt {0, 1}, output {2, 3}
    (SP(presence_penalty=0.5), [2.0, -2.0, 0.5, -1.5, 0.5, 3.0]),
    (SP(frequency_penalty=0.25), [2.0, -2.0, 0.5, -1.25, 0.5, 3.0]),   # token 2 twice, token 3 once
    (SP(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
     [1.0, -4.0, -0.5, -2.75, 0.5, 3.0]),
    (SP(presence_penalty=-1.0), [2.0, -2.0, 2.0, 0.0, 0.5, 3.0]),
])
def test_penalties_change_logits_as_specified(params, expected):
    meta = SamplingMetadata.from_params([params], [0], [3], 6, "cpu", prompt_token_ids=[[0, 1]],
                                        output_token_ids=[[2, 2, 3]])
    logits = torch.tensor([ROW])
    apply_penalties(logits, meta.penalties)
    assert logits.tolist() == [expected]


def test_repetition_penalty_moves_the_greedy_choice_and_leaves_input_untouched():
    logits = torch.tensor([ROW, ROW])
    before = logits.clone()
    out = run(logits, [SP(temperature=0, repetition_penalty=4.0), SP(temperature=0)],
              prompts=[[5], [5]], outputs=[[], []])
    assert out.token_ids.tolist() == [0, 5]
    assert torch.equal(logits, before)


@pytest.mark.parametrize("row,expected", [
    ([1.0, 5.0, 5.0, 2.0], 1),
    ([0.0, 0.0, 0.0], 0),
    ([float("-inf"), 2.0, float("-inf"), 2.0], 1),
    ([-3.0, -1.0, -1.0, -2.0], 1),
])
def test_greedy_takes_the_lowest_id_among_ties(row, expected):
    out = run(torch.tensor([row]), [SP(temperature=0)])
    assert out.token_ids.tolist() == [expected]
