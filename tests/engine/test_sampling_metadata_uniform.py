"""SamplingMetadata's shortcuts give the metadata of the full per-row build: one params object shared by every
row (read once), token ids gathered only when a row reads them, seeds taken as they are when in int64."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from deepinfer.engine.core.sequence import Sequence
from deepinfer.engine.sample.metadata import PenaltyData, SamplingMetadata
from deepinfer.engine.sample.params import SamplingParams

VOCAB = 64
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7, 9]),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
    SamplingParams(temperature=0.0, logprobs=2),
]


def _seqs(params: list[SamplingParams], seeds: list[int]) -> list[Sequence]:
    seqs = []
    for i, (p, seed) in enumerate(zip(params, seeds, strict=True)):
        s = Sequence(seq_id=i, prompt_token_ids=[1 + i, 2, 3 + i], params=p, seed=seed,
                     eos_token_ids=frozenset({1}))
        s.output_token_ids = [5 + i] * (i % 3)
        seqs.append(s)
    return seqs


def _fields(meta: SamplingMetadata | PenaltyData | None) -> dict:
    if meta is None:
        return {}
    out = {}
    for f in dataclasses.fields(meta):
        v = getattr(meta, f.name)
        if isinstance(v, (SamplingMetadata, PenaltyData)):
            v = _fields(v)
        elif isinstance(v, torch.Tensor):
            v = (v.dtype, v.tolist())
        out[f.name] = v
    return out


SEEDS = [[3, 2**62, -4, -(2**63), 0, 2**63 - 1],          # all in int64: taken as they are
         [3, 2**63 + 5, -4, 2**70 + 1, 0, 2**63 - 1]]     # some outside: reduced mod 2**64


@pytest.mark.parametrize("seeds", SEEDS, ids=["int64", "wide"])
@pytest.mark.parametrize("for_kernel", [False, True])
@pytest.mark.parametrize("p", PARAMS, ids=range(len(PARAMS)))
def test_one_shared_params_object_gives_the_per_row_metadata(p, for_kernel, seeds):
    n = len(seeds)
    shared = _seqs([p] * n, seeds)
    copies = _seqs([dataclasses.replace(p) for _ in range(n)], seeds)   # equal values, distinct objects
    assert all(a.params is not b.params for a, b in zip(shared, copies, strict=True))
    got, want = (SamplingMetadata.from_params([s.params for s in x], [s.seed for s in x],
                                              [s.num_output_tokens for s in x], VOCAB, "cpu",
                                              for_kernel=for_kernel, **_tokens(x)) for x in (shared, copies))
    assert _fields(got) == _fields(want)
    if for_kernel:   # the kernel's packed seeds are the reduced ones
        from deepinfer.engine.sample.rng import to_int64

        assert got.row_params[0].tolist() == [to_int64(x) for x in seeds]
    # from_sequences leaves out the token ids no row reads: the same metadata as passing them all.
    if not for_kernel:
        assert _fields(SamplingMetadata.from_sequences(shared, VOCAB, "cpu")) == _fields(want)


def _tokens(seqs: list[Sequence]) -> dict:
    return {"prompt_token_ids": [s.prompt_token_ids for s in seqs],
            "output_token_ids": [s.output_token_ids for s in seqs],
            "eos_token_ids": [s.eos_token_ids for s in seqs]}


def test_mixed_params_batch_is_unchanged_by_the_shortcuts():
    seeds = list(range(len(PARAMS)))
    seqs = _seqs(PARAMS, seeds)
    full = SamplingMetadata.from_params([s.params for s in seqs], seeds, [s.num_output_tokens for s in seqs],
                                        VOCAB, "cpu", **_tokens(seqs))
    assert _fields(SamplingMetadata.from_sequences(seqs, VOCAB, "cpu")) == _fields(full)
    assert full.blocked_rows is not None and full.penalties is not None   # the rows that read token ids
