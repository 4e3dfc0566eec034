"""Logit penalties and min_tokens blocking (steps 1-3 of the sampler's order of operations).

All of it is elementwise on the penalised rows, and neutral parameters are exact identities
(x / 1 == x, x * 1 == x, x - 0 == x), so a row's logits never depend on which other rows are penalised.
"""

from __future__ import annotations

import torch
from deepinfer.engine.sample.metadata import PenaltyData


def apply_penalties(logits: torch.Tensor, pen: PenaltyData) -> None:
    """In place on float32 logits [S, V], for the rows `pen.rows`.

    Repetition penalty r (tokens seen in prompt or output): positive logits are divided by r, negative ones
    multiplied by r. Then presence p and frequency f penalties on output tokens:
    logit -= f * count + p * (count > 0).
    """
    rows = logits.index_select(0, pen.rows)
    if pen.seen is not None:
        r = pen.repetition.unsqueeze(1)
        penalised = torch.where(rows > 0, rows / r, rows * r)
        rows = torch.where(pen.seen, penalised, rows)
    if pen.output_counts is not None:
        counts = pen.output_counts
        present = (counts > 0).to(torch.float32)
        rows = rows - (pen.frequency.unsqueeze(1) * counts + pen.presence.unsqueeze(1) * present)
    logits.index_copy_(0, pen.rows, rows)


def apply_blocked(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
    """In place: logits[rows[j], tokens[j]] = -inf (EOS and stop ids of rows still below min_tokens)."""
    # A device-side fill: torch.tensor(-inf, device=...) would copy from the host and wait for the device.
    logits.index_put_((rows, tokens), torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device))
