"""The overlapped engine loop: the host prepares step N+1 while the device runs step N.

One iteration, with step N's sampling in flight on the device:
  1. schedule N+1 optimistically: every sequence that sampled in step N is taken to continue, its token
     standing in its output as PENDING_TOKEN (sequence.py); one the token rules certainly end (max_tokens,
     max_model_len) is left out (scheduler._schedule_running);
  2. commit and launch N+1's forward; a placeholder input is read on the device from step N's sampled ids,
     so the launch needs nothing from the host;
  3. read step N's ids (the one small device -> host copy, ready long before N+1's forward is) and apply
     them (`Scheduler.update(..., launched=True)`): placeholders resolved, stop tokens / strings, grammar
     advance, detokenization, finished requests freed and reported;
  4. launch N+1's sampling for the sequences still alive. A sequence that step N finished is dropped here:
     its N+1 forward row is wasted work, never an output. Sampling N+1 comes after 3, so grammar masks,
     penalties and min_tokens see token N exactly as in the synchronous loop, and constrained requests
     need no special case.
Every request therefore samples the same tokens from the same inputs as in the synchronous loop
(engine_core.EngineCore.step); with batch-invariant kernels the bits are identical. What differs is only
the schedule (a finished sequence holds its slot and blocks one step longer), which in deterministic mode
changes no output. On CPU the device is synchronous and this is only a reordering, which is what lets the
CPU tests check the bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from deepinfer.engine.core.scheduler_output import SchedulerOutput
from deepinfer.engine.core.sequence import PENDING_TOKEN, Sequence, SequenceStatus

if TYPE_CHECKING:
    from deepinfer.engine.core.engine_core import EngineCore
    from deepinfer.engine.core.request_feed import RequestFeed
    from deepinfer.engine.runner.step_executor import SampledTokens


_FINISHED = SequenceStatus.FINISHED


@dataclass
class InFlight:
    """A step whose sampling is launched but whose ids the host has not applied yet."""

    out: SchedulerOutput       # the step as scheduled
    tokens: SampledTokens      # its sampled ids (device now, host after resolve)


@dataclass
class OverlapStats:
    """Counters of the overlapped loop (LLM.get_stats)."""

    steps: int = 0             # forwards launched
    overlapped: int = 0        # forwards launched while the previous step's ids were still unread
    wasted_rows: int = 0       # forward rows of sequences found finished before their sampling


def run_overlapped(core: EngineCore, on_finish: Callable[[Sequence], None], stats: OverlapStats,
                   feed: RequestFeed) -> None:
    """Step `core` until no request is pending, one step in flight, calling `on_finish` as requests end.
    `feed`'s requests are built before a schedule, while the device runs the step in flight."""
    sched, executor = core.scheduler, core.executor
    inflight: InFlight | None = None
    try:
        while inflight is not None or core.pending(feed):
            feed.top_up(core)
            out = sched.schedule()
            fwd = None
            if not out.is_empty:
                sched.commit_launch(out)
                fwd = executor.forward(out, inflight.tokens if inflight is not None else None)
                stats.steps += 1
                stats.overlapped += inflight is not None
            elif inflight is None:
                raise RuntimeError("scheduler produced an empty step while requests are pending")
            if inflight is not None:
                _apply(core, inflight, on_finish)
                inflight = None
            if fwd is not None:
                sampled = out.sampled_seqs()
                alive = [seq for seq in sampled if seq.status is not _FINISHED]
                stats.wasted_rows += len(sampled) - len(alive)
                tokens = executor.sample(fwd, alive)
                for seq in alive:
                    seq.output_token_ids.append(PENDING_TOKEN)
                inflight = InFlight(out, tokens)
    finally:
        # On an error, leave no placeholder behind in sequences the caller aborts.
        if inflight is not None:
            for seq in inflight.out.sampled_seqs():
                if seq.has_pending_token:
                    seq.output_token_ids.pop()


def _apply(core: EngineCore, step: InFlight, on_finish: Callable[[Sequence], None]) -> None:
    finished = core.scheduler.update(step.out, step.tokens.resolve(), launched=True)
    for seq in finished:
        if core.structured is not None:
            core.structured.free(seq)
        on_finish(seq)
