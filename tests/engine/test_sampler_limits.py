"""Sampler: min_tokens, metadata from sequences, logprobs, bad input, CUDA against CPU bits."""

from __future__ import annotations

import pytest
import torch
from deepinfer.engine.core.sequence import Sequence
from deepinfer.engine.sample.metadata import SamplingMetadata
from deepinfer.engine.sample.params import SamplingParams as SP
from deepinfer.engine.sample.rng import random_bits, row_keys
from deepinfer.engine.sample.sampler import (
    Sampler,
    raw_logprobs,
)

from tests.support.sampler_harness import (
    EOS,
    _assert_rows_invariant,
    _mixed_batch,
    run,
)

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
