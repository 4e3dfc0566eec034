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


@dataclass(frozen=True)
class DecodeBatch:
    """A step in which every scheduled sequence decodes one token at its last position and samples it, in
    columns: what `ScheduledSequence(seqs[i], starts[i], 1, True)` rows would say, without building them.
    The scheduler's decode fast path makes one; the loop, the executor and `Scheduler.update` read it."""

    seqs: list[Sequence]     # batch order; each appears once
    starts: list[int]        # starts[i]: the position seqs[i] computes (its num_computed_tokens at schedule)


class SchedulerOutput:
    """What the model runner executes in one forward pass."""

    __slots__ = ("_scheduled", "preempted", "num_batched_tokens", "decode", "_sampled")

    def __init__(self, scheduled: list[ScheduledSequence] | None = None,
                 preempted: list[Sequence] | None = None, num_batched_tokens: int = 0,
                 decode: DecodeBatch | None = None) -> None:
        """scheduled and decode are exclusive: a decode batch's rows are built from it on first use."""
        if scheduled is not None and decode is not None:
            raise ValueError("SchedulerOutput: give scheduled rows or a decode batch, not both")
        # Sequences in batch order; prefill chunks and decodes mixed. Each appears at most once. None while
        # only `decode` describes the step (the `scheduled` property builds the rows then).
        self._scheduled = scheduled if scheduled is not None or decode is not None else []
        # Sequences preempted (KV freed, to be recomputed) while building this step.
        self.preempted: list[Sequence] = preempted if preempted is not None else []
        # Sum of num_new_tokens: never above max_num_batched_tokens.
        self.num_batched_tokens = num_batched_tokens
        # The same step in columns when it is a pure decode step built by the fast path; else None.
        self.decode = decode
        # `sampled` memo: (the `scheduled` list and its length it was built from, the result). `scheduled`
        # only grows (by schedule()), and the loop reads `sampled` several times per step.
        self._sampled: tuple[list[ScheduledSequence], int, list[ScheduledSequence]] | None = None

    @property
    def scheduled(self) -> list[ScheduledSequence]:
        """The step's rows (built once from `decode` when the fast path made the step)."""
        rows = self._scheduled
        if rows is None:
            d = self.decode
            rows = self._scheduled = [ScheduledSequence(q, st, 1, True) for q, st in zip(d.seqs, d.starts)]
        return rows

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SchedulerOutput):
            return NotImplemented
        return (self.scheduled, self.preempted, self.num_batched_tokens) == (
            other.scheduled, other.preempted, other.num_batched_tokens)

    __hash__ = None   # mutable, compared by value

    def __repr__(self) -> str:
        return (f"SchedulerOutput(scheduled={self.scheduled!r}, preempted={self.preempted!r}, "
                f"num_batched_tokens={self.num_batched_tokens})")

    @property
    def is_empty(self) -> bool:
        return self.decode is None and not self.scheduled

    @property
    def num_rows(self) -> int:
        """Scheduled sequences."""
        return len(self.decode.seqs) if self.decode is not None else len(self.scheduled)

    @property
    def sampled(self) -> list[ScheduledSequence]:
        """The scheduled sequences that sample this step, in batch order (do not modify the list)."""
        memo, sched = self._sampled, self.scheduled
        if memo is None or memo[0] is not sched or memo[1] != len(sched):
            memo = self._sampled = (sched, len(sched), [s for s in sched if s.sample])
        return memo[2]

    def sampled_seqs(self) -> list[Sequence]:
        """The sequences of `sampled`, in order (a decode batch's own list: do not modify it)."""
        if self.decode is not None:
            return self.decode.seqs
        return [s.seq for s in self.sampled]


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
    # The sequences of the rows (seqs[i].seq_id == seq_ids[i]) when the producer holds them (the step
    # executor does): Scheduler.update then matches rows to the step by identity, not by id. None: by id.
    seqs: list[Sequence] | None = None
