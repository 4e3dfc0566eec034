"""Sampler: exact filtered-distribution sampling, batch invariance, penalties, logprobs, min_tokens."""

from __future__ import annotations

import math
import random

import pytest
import torch
from deepinfer.engine.core.sequence import Sequence
from deepinfer.engine.sample import sampler as sampler_module
from deepinfer.engine.sample.metadata import SamplingMetadata
from deepinfer.engine.sample.params import SamplingParams as SP
from deepinfer.engine.sample.penalties import apply_penalties
from deepinfer.engine.sample.rng import random_bits, row_keys
from deepinfer.engine.sample.sampler import (
    Sampler,
    SamplerOutput,
    first_k_mask,
    min_p_mask,
    raw_logprobs,
    top_k_top_p_mask,
)

EOS = 3


def run(logits, params, seeds=None, positions=None, prompts=None, outputs=None, eos=None,
        device="cpu") -> SamplerOutput:
    n = len(params)
    meta = SamplingMetadata.from_params(
        params, seeds=seeds if seeds is not None else [11] * n,
        positions=positions if positions is not None else [0] * n,
        vocab_size=logits.shape[1], device=device, prompt_token_ids=prompts, output_token_ids=outputs,
        eos_token_ids=eos,
    )
    return Sampler()(logits, meta)


# ---------------------------------------------------------------------------------------------------------
# Batch invariance

MIXED = [
    SP(temperature=0),
    SP(temperature=0, repetition_penalty=1.5),
    SP(temperature=1.0),
    SP(temperature=0.7, top_k=5),
    SP(temperature=1.3, top_p=0.8),
    SP(top_k=10, top_p=0.6),
    SP(min_p=0.1),
    SP(temperature=0.9, top_p=0.9, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3),
    SP(repetition_penalty=1.2, logprobs=3),
    SP(temperature=0.5, min_tokens=4, logprobs=0),
    SP(top_k=1),
    SP(temperature=0, logprobs=5),
    SP(temperature=2.0, top_k=3, min_p=0.3, frequency_penalty=-0.5),
]


def _mixed_batch(vocab: int, seed: int, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    rows = [rng.choice(MIXED) for _ in range(24)] + MIXED
    n = len(rows)
    # Coarse values create ties; a few -inf entries stand in for a structured-output mask.
    logits = torch.round(torch.randn(n, vocab, generator=gen) * 30) / 10
    logits[torch.rand(n, vocab, generator=gen) < 0.2] = float("-inf")
    logits[:, 0] = 1.0
    args = dict(
        seeds=[rng.randrange(2**63) for _ in range(n)],
        positions=[rng.randrange(6) for _ in range(n)],
        prompts=[[rng.randrange(vocab) for _ in range(rng.randrange(1, 9))] for _ in range(n)],
        outputs=[[rng.randrange(vocab) for _ in range(rng.randrange(0, 6))] for _ in range(n)],
        eos=[[EOS] for _ in range(n)],
    )
    return rows, logits.to(device), args


def _take(args: dict, order: list[int]) -> dict:
    return {k: [v[i] for i in order] for k, v in args.items()}


def _assert_rows_invariant(rows, logits, args, device="cpu"):
    n = len(rows)
    order = list(range(n))
    random.Random(1).shuffle(order)
    batch = run(logits[order], [rows[i] for i in order], **_take(args, order), device=device)
    batch_tokens = batch.token_ids.tolist()
    subset = order[: n // 3]
    part = run(logits[subset], [rows[i] for i in subset], **_take(args, subset), device=device)
    for j, i in enumerate(order):
        alone = run(logits[i : i + 1], [rows[i]], **_take(args, [i]), device=device)
        assert alone.token_ids.tolist() == [batch_tokens[j]], f"row {i} ({rows[i]})"
        # Same keys in the same order, bitwise-equal values.
        assert list((alone.logprobs[0] or {}).items()) == list((batch.logprobs[j] or {}).items())
        if j < len(subset):
            assert part.token_ids[j].item() == batch_tokens[j]


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


STOP = 5


@pytest.mark.parametrize("params,num_outputs,expected", [
    (SP(temperature=0, min_tokens=2, stop_token_ids=[STOP]), 0, 1),   # EOS and stop id blocked
    (SP(temperature=0, min_tokens=2, stop_token_ids=[STOP]), 1, 1),
    (SP(temperature=0, min_tokens=2, stop_token_ids=[STOP]), 2, EOS),  # min_tokens reached
    (SP(temperature=0, min_tokens=2, stop_token_ids=[STOP], ignore_eos=True), 0, EOS),
    (SP(temperature=0, stop_token_ids=[STOP]), 0, EOS),
])
def test_min_tokens_blocks_eos_and_stop_ids(params, num_outputs, expected):
    logits = torch.tensor([[0.0, 4.0, 0.0, 9.0, 0.0, 8.0]])
    seq = Sequence(seq_id=0, prompt_token_ids=[0], params=params, seed=1, eos_token_ids=frozenset({EOS}),
                   output_token_ids=[2] * num_outputs)
    meta = SamplingMetadata.from_sequences([seq], 6, "cpu")
    assert Sampler()(logits, meta).token_ids.tolist() == [expected]


def test_min_tokens_blocks_eos_for_random_draws_at_every_early_position():
    n = 300
    logits = torch.tensor([[0.0, 0.0, 0.0, 1.0]] * n)
    out = run(logits, [SP(min_tokens=5)] * n, seeds=list(range(n)), positions=[i % 5 for i in range(n)],
              eos=[[EOS]] * n)
    assert EOS not in out.token_ids.tolist()


def test_from_sequences_uses_seed_and_output_count_as_position():
    seqs = [Sequence(seq_id=i, prompt_token_ids=[1, 2], params=SP(top_p=0.9), seed=100 + i,
                     output_token_ids=[4] * i) for i in range(3)]
    meta = SamplingMetadata.from_sequences(seqs, 10, "cpu")
    assert meta.positions.tolist() == [0, 1, 2] and meta.seeds.tolist() == [100, 101, 102]
    direct = SamplingMetadata.from_params([s.params for s in seqs], [100, 101, 102], [0, 1, 2], 10, "cpu")
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    assert torch.equal(Sampler()(logits, meta).token_ids, Sampler()(logits, direct).token_ids)


# ---------------------------------------------------------------------------------------------------------
# Logprobs

@pytest.mark.parametrize("params", [
    SP(temperature=0.5, repetition_penalty=1.7, logprobs=5),
    SP(temperature=0, logprobs=3, presence_penalty=1.0),
    SP(top_k=2, logprobs=0),
    SP(logprobs=20),
])
def test_logprobs_are_log_softmax_of_raw_logits_for_sampled_and_top_tokens(params):
    raw = torch.randn(1, 50, generator=torch.Generator().manual_seed(3)) * 3
    out = run(raw, [params], prompts=[[int(raw.argmax())]], outputs=[[1, 2]])
    reference = torch.log_softmax(raw.double(), dim=1)[0]
    entry = out.logprobs[0]
    sampled = out.token_ids.item()
    top = torch.topk(raw[0], params.logprobs).indices.tolist()
    assert next(iter(entry)) == sampled
    assert set(entry) == {sampled, *top}
    for token, value in entry.items():
        assert value == pytest.approx(reference[token].item(), abs=1e-9)


def test_logprobs_none_rows_get_none():
    out = run(torch.zeros(2, 4), [SP(logprobs=1), SP()])
    assert out.logprobs[1] is None and out.logprobs[0] is not None


def test_fixed_point_log_softmax_is_accurate_on_a_large_vocab():
    raw = torch.randn(2, 128256, generator=torch.Generator().manual_seed(0)) * 4
    raw[1, ::3] = float("-inf")
    got = raw_logprobs(raw)
    want = torch.log_softmax(raw.double(), dim=1)
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    assert (got[finite] - want[finite]).abs().max().item() < 1e-9


# ---------------------------------------------------------------------------------------------------------
# Errors

@pytest.mark.parametrize("logits,match", [
    (torch.zeros(2, 5), "does not match"),
    (torch.zeros(1, 6), "does not match"),
    (torch.zeros(1, 5, dtype=torch.int64), "must be float"),
])
def test_bad_logits_raise_value_error(logits, match):
    meta = SamplingMetadata.from_params([SP()], [0], [0], 5, "cpu")
    with pytest.raises(ValueError, match=match):
        Sampler()(logits, meta)


def test_metadata_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="seeds"):
        SamplingMetadata.from_params([SP(), SP()], [0], [0, 0], 5, "cpu")


# ---------------------------------------------------------------------------------------------------------
# CUDA (run by the lead on the GPU machine)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_cuda_random_bits_equal_cpu_bits():
    seeds = torch.tensor([0, -5, 2**62, 123456789])
    positions = torch.tensor([0, 1, 1000, 7])
    tokens = torch.arange(128256)
    cpu = random_bits(row_keys(seeds, positions), tokens)
    gpu = random_bits(row_keys(seeds.cuda(), positions.cuda()), tokens.cuda())
    assert torch.equal(cpu, gpu.cpu())


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("vocab,seed", [(128256, 0), (1000, 1)])
def test_cuda_rows_sample_the_same_alone_as_in_a_mixed_batch(vocab, seed):
    _assert_rows_invariant(*_mixed_batch(vocab, seed, device="cuda"), device="cuda")
