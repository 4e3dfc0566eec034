"""Shared sampler-test helpers: run the Sampler on explicit rows; mixed batches for invariance checks."""

from __future__ import annotations

import random

import torch
from deepinfer.engine.sample.metadata import SamplingMetadata
from deepinfer.engine.sample.params import SamplingParams as SP
from deepinfer.engine.sample.sampler import (
    Sampler,
    SamplerOutput,
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
