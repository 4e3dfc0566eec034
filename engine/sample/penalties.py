"""Logit penalties and min_tokens blocking (steps 1-3 of the sampler's order of operations).

Penalties touch only the logits of tokens a row has seen (the sparse entries of `PenaltyData`), and
neutral parameters are exact identities (x / 1 == x, x * 1 == x, x - 0 == x), so a row's logits never
depend on which other rows are penalised.
"""

from __future__ import annotations

import torch
from deepinfer.engine.sample.metadata import PenaltyData
from deepinfer.kernels.reference.penalties import apply_penalties_ref


def apply_penalties(logits: torch.Tensor, pen: PenaltyData, kernel: bool = False) -> None:
    """In place on float32 logits [S, V], for the rows `pen.rows`.

    Repetition penalty r (tokens seen in prompt or output): positive logits are divided by r, negative ones
    multiplied by r. Then presence p and frequency f penalties on output tokens:
    logit -= f * count + p * (count > 0). `kernel`: one Triton launch (kernels/penalties.py, the same bits)
    instead of torch's gather / arithmetic / scatter.
    """
    if kernel:
        from deepinfer.kernels.penalties import apply_penalties as apply_kernel

        apply_kernel(logits, pen.rows, pen.params, pen.entries)
    else:
        apply_penalties_ref(logits, pen.rows, pen.params, pen.entries)


def apply_blocked(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
    """In place: logits[rows[j], tokens[j]] = -inf (EOS and stop ids of rows still below min_tokens)."""
    # A device-side fill: torch.tensor(-inf, device=...) would copy from the host and wait for the device.
    logits.index_put_((rows, tokens), torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device))
