"""Typed hand-offs of one engine step: scheduler -> model runner -> scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.engine.core.sequence import Sequence


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of a step (slotted: a decode step creates one per running sequence)."""

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
    # `sampled` memo: (the `scheduled` list and its length it was built from, the result). `scheduled` only
    # grows (by schedule()), and the loop reads `sampled` several times per step.
    _sampled: tuple[list[ScheduledSequence], int, list[ScheduledSequence]] | None = field(
        default=None, repr=False, compare=False)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def sampled(self) -> list[ScheduledSequence]:
        """The scheduled sequences that sample this step, in batch order (do not modify the list)."""
        memo, sched = self._sampled, self.scheduled
        if memo is None or memo[0] is not sched or memo[1] != len(sched):
            memo = self._sampled = (sched, len(sched), [s for s in sched if s.sample])
        return memo[2]


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
