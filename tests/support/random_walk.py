"""Drive structured output with a seeded random "model", the way the engine does, without a model.

Each step: fill the bitmask rows of the unfinished requests (`fill_bitmask_async`), draw random logits per
row while the fill runs, apply the masks with `apply_token_bitmask_`, sample at temperature 1.0, `accept`,
and finish a request on `is_terminated` ("stop") or at max_tokens ("length"). Every row has its own
generator seeded from (seed, row), so a request's walk does not depend on which others share the batch.
Used by the tests (every finished output must validate) and by the steering measurements.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from deepinfer.engine.sample.params import SamplingParams
from deepinfer.engine.structured.manager import StructuredOutputManager
from deepinfer.kernels.masking import apply_token_bitmask_


@dataclass(frozen=True)
class WalkResult:
    token_ids: list[int]
    text: str
    finish_reason: str          # "stop" (grammar terminated) or "length" (budget exhausted first)


def random_walks(manager: StructuredOutputManager, params: Sequence[SamplingParams],
                 decode: Callable[[list[int]], str], seed: int = 0) -> list[WalkResult]:
    """Generate one output per request of `params` (each must be constrained and have max_tokens)."""
    n = len(params)
    if any(p.max_tokens is None for p in params):
        raise ValueError("random_walks: every request needs max_tokens")
    states = [manager.new_matcher(p) for p in params]
    gens = [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(n)]
    outputs: list[list[int]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    v = manager.vocab_size
    while True:
        active = [i for i in range(n) if reasons[i] is None]
        if not active:
            break
        bitmask = manager.allocate_bitmask(len(active))
        rows = [(j, states[i], params[i].max_tokens - len(outputs[i])) for j, i in enumerate(active)]
        job = manager.fill_bitmask_async(rows, bitmask)
        logits = torch.stack([torch.randn(v, generator=gens[i]) for i in active])
        job.result()
        apply_token_bitmask_(logits, bitmask, torch.arange(len(active)))
        probs = torch.softmax(logits, dim=-1)
        for j, i in enumerate(active):
            token = int(torch.multinomial(probs[j], 1, generator=gens[i]))
            outputs[i].append(token)
            if not manager.accept(states[i], token):
                raise AssertionError(f"request {i}: sampled token {token} was rejected by its grammar")
            if manager.is_terminated(states[i]):
                reasons[i] = "stop"
            elif len(outputs[i]) >= params[i].max_tokens:
                reasons[i] = "length"
    return [WalkResult(out, decode(out), r) for out, r in zip(outputs, reasons, strict=True)]
