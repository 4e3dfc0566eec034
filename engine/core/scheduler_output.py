"""Typed hand-offs of one engine step: scheduler -> model runner -> scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.engine.core.sequence import Sequence


@dataclass
class ScheduledSequence:
    """One sequence's share of a step."""

    seq: Sequence
    # Tokens computed this step: positions [start, start + num_new_tokens) of seq.token_ids.
    start: int
    num_new_tokens: int
    # True when this step computes the sequence's last uncomputed token, so its logits are sampled.
    sample: bool
    # MTP verify step (engine/spec_decode/): draft tokens appended after the sequence's last token, so the
    # step computes positions [start, start + num_new_tokens) with num_new_tokens = 1 + len(draft) and
    # samples every one of them. Empty for an ordinary step.
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """What the model runner executes in one forward pass."""

    # Sequences in batch order; prefill chunks and decodes mixed. Each appears at most once.
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    # Sequences preempted (KV freed, to be recomputed) while building this step.
    preempted: list[Sequence] = field(default_factory=list)
    # Sum of num_new_tokens: never above max_num_batched_tokens.
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def sampled(self) -> list[ScheduledSequence]:
        return [s for s in self.scheduled if s.sample]


@dataclass
class ModelRunnerOutput:
    """What one forward pass produced, for the sequences that sampled (in `SchedulerOutput.sampled` order)."""

    seq_ids: list[int]
    token_ids: list[int]
    # Per sampled row: token id -> logprob (sampled token + top-k), or None when not requested.
    logprobs: list[dict[int, float] | None]
    # MTP verify steps (engine/spec_decode/): seq_id -> every token the step commits for that sequence (the
    # accepted drafts, then the target's own token), and their logprob entries, in order. The first entry
    # equals token_ids[j]. Sequences absent here commit token_ids[j] alone. None on ordinary steps.
    spec_token_ids: dict[int, list[int]] | None = None
    spec_logprobs: dict[int, list[dict[int, float] | None]] | None = None
