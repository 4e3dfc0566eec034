"""Requests handed to the engine as its scheduler needs them, not all before the first step.

Building a request (its default seed, a BLAKE2b over the prompt's ids, and its `Sequence` objects) costs
tens of microseconds of host time. Built all up front, 256 prompts of 512 tokens held the device idle for
~50 ms before the first step on the H200 host: ~6% of a whole 0.5B run of 256 x 512 -> 256 tokens
(benchmarks/RESULTS.md). A `RequestFeed` builds them a chunk at a time from inside the engine loop, before
each `schedule()`: only the first step's requests are built before the device starts, the rest while it
runs a step (in the overlapped loop the previous step is in flight there).

The schedule stays the one the scheduler makes with every request queued: admission is FCFS and stops
at the first request that does not fit (core/scheduler.py), so what a step admits depends only on a prefix
of the waiting queue. The feed keeps that queue at least as long as the step can admit: as many requests
as there are free sequence slots, or a whole step's token budget of tokens to compute (past each request's
cached prefix, `Scheduler.admission_tokens`, which admission can only find larger). A slot freed by a
preemption admits nothing in its step, and nothing finishes inside `schedule()`, so the slots counted
here are the step's. (Outputs would not change even if the schedule did: a request's tokens never depend
on the batch.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepinfer.engine.core.sequence import Sequence

if TYPE_CHECKING:
    from deepinfer.engine.core.engine_core import EngineCore

# Requests built per call of `build`: large enough to amortise the seed pass's per-call cost, small enough
# that the first step waits for little more than its own requests.
FEED_CHUNK = 16
# Set to 1 to build every request of a `generate` call before its first step (A/B runs).
QUEUE_ALL_ENV = "DEEPINFER_QUEUE_ALL_REQUESTS"


@dataclass
class RequestFeed:
    """Requests 0 .. total - 1, built in index order by `build(first, stop)` (each request's sequences,
    all samples of one request together) and added to the engine when its waiting queue runs short."""

    build: Callable[[int, int], list[list[Sequence]]]
    total: int
    chunk: int = FEED_CHUNK
    added: int = field(default=0, init=False)    # requests built and added so far

    def __post_init__(self) -> None:
        if self.total < 0 or self.chunk < 1:
            raise ValueError(f"RequestFeed: total={self.total} must be >= 0 and chunk={self.chunk} >= 1")

    @property
    def exhausted(self) -> bool:
        return self.added >= self.total

    def top_up(self, core: EngineCore) -> None:
        """Add requests until the scheduler's waiting queue holds what its next step could admit."""
        if self.exhausted:
            return
        sched = core.scheduler
        slots = sched.cfg.max_num_seqs - len(sched.running)
        count = len(sched.waiting)
        if count >= slots:
            return
        budget = sched.cfg.max_num_batched_tokens
        tokens = 0
        for seq in sched.waiting:
            if tokens >= budget:
                return
            tokens += sched.admission_tokens(seq)
        while not self.exhausted and count < slots and tokens < budget:
            stop = min(self.added + self.chunk, self.total)
            for group in self.build(self.added, stop):
                for seq in group:
                    core.add(seq)
                    count += 1
                    tokens += sched.admission_tokens(seq)
            self.added = stop
