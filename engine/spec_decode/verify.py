"""Exact verification of MTP drafts: the draft changes which tokens are computed together, never a token.

A verify step feeds a request's last token and its drafts d_1..d_k in one target pass and samples every
position. Row j (0 <= j <= k) samples output position n + j (n = outputs so far) with the sampling state
the plain run would have there if d_1..d_j were committed: the same seed and position (so the same noise,
engine/sample/rng.py), penalties over outputs + d_1..d_j, min_tokens by position. With batch-invariant ops
the row's logits are the plain run's bits too. So row j's token is exactly the token the plain run samples
at output n + j, as long as d_1..d_j are what the plain run sampled before it. Hence the rule: accept d_{j+1}
while it equals row j's token; at the first mismatch (or after all k) commit row j's token, which the plain
run samples there as well. The committed tokens and their logprob entries are the plain run's, byte for
byte, also at temperature > 0. The finish rules then run token by token (scheduler._commit_verified).

Requests with a grammar (json_schema / regex / choice) never draft: their mask for row j would need the
grammar advanced over unverified drafts. Their single row is masked as in a plain step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from deepinfer.engine.core.scheduler_output import ScheduledSequence
from deepinfer.engine.core.sequence import Sequence
from deepinfer.engine.sample.metadata import SamplingMetadata
from deepinfer.engine.sample.penalty_tokens import sequence_entries
from deepinfer.engine.sample.sampler import Sampler


@dataclass
class Verified:
    """What one sampled sequence commits this step."""

    tokens: list[int]                          # accepted drafts, then the target's token
    logprobs: list[dict[int, float] | None]    # per token, as the sampler gave it
    num_drafted: int
    num_accepted: int


def row_sequences(sampled: list[ScheduledSequence]) -> list[Sequence]:
    """The sequence of each sampled row, in row order: 1 + len(drafts) rows per sequence."""
    return [s.seq for s in sampled for _ in range(1 + len(s.draft_token_ids))]


def rows_metadata(sampled: list[ScheduledSequence], vocab_size: int, device: torch.device
                  ) -> SamplingMetadata:
    """Per-row sampling state of a verify step: row j of a sequence as if drafts d_1..d_j were committed."""
    params, seeds, positions, eos = [], [], [], []
    pen_rows: list[tuple[Sequence, list[int]]] = []
    for s in sampled:
        seq, drafts = s.seq, s.draft_token_ids
        for j in range(len(drafts) + 1):
            params.append(seq.params)
            seeds.append(seq.seed)
            positions.append(seq.num_output_tokens + j)
            pen_rows.append((seq, drafts[:j]))
            eos.append(seq.eos_token_ids)
    return SamplingMetadata.from_params(
        params, seeds, positions, vocab_size, device, eos_token_ids=eos,
        # Penalties count d_1..d_j as outputs: the sequence's kept table with the drafts added to a copy.
        penalty_entries=lambda i: sequence_entries(pen_rows[i][0], vocab_size, pen_rows[i][1]))


def num_accepted(drafts: list[int], row_tokens: list[int]) -> int:
    """Leading drafts equal to the target's token of the row before them (row_tokens has len(drafts) + 1)."""
    a = 0
    while a < len(drafts) and drafts[a] == row_tokens[a]:
        a += 1
    return a


def sample_and_verify(sampler: Sampler, logits: torch.Tensor, sampled: list[ScheduledSequence],
                      masks=None) -> list[Verified]:
    """Sample every row of `logits` [rows, V] (row order of `row_sequences`) and apply the acceptance rule.

    `masks` (structured outputs, built for row_sequences(sampled)) is applied first."""
    if masks is not None:
        masks.apply(logits)
    meta = rows_metadata(sampled, logits.shape[-1], logits.device)
    result = sampler(logits, meta)
    ids = result.token_ids.tolist()
    out: list[Verified] = []
    row = 0
    for s in sampled:
        k = len(s.draft_token_ids)
        tokens = ids[row:row + k + 1]
        a = num_accepted(s.draft_token_ids, tokens)
        out.append(Verified(tokens[:a + 1], result.logprobs[row:row + a + 1], k, a))
        row += k + 1
    return out
