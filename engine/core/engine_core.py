"""The engine loop: schedule -> execute -> update, until every request has finished."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from deepinfer.engine.core.gc_scope import quiet_gc
from deepinfer.engine.core.overlap import OverlapStats, run_overlapped
from deepinfer.engine.core.request_feed import RequestFeed
from deepinfer.engine.core.scheduler import Scheduler
from deepinfer.engine.core.sequence import Sequence
from deepinfer.engine.runner.model_runner import ModelRunner
from deepinfer.engine.runner.step_executor import StepExecutor
from deepinfer.engine.text.output_processor import OutputProcessor

if TYPE_CHECKING:
    from deepinfer.engine.spec_decode.step import SpecDecoder
    from deepinfer.engine.structured.lazy import LazyStructuredOutputs


class EngineCore:
    """Drives one model replica. Single-threaded: the scheduler and block manager are plain CPU state.

    Owns each request's lifetime in the engine: `add` gives it its detokenizer (outputs) and grammar
    state (structured), the scheduler's finish rules end it, and its grammar state is dropped as soon as
    it finishes or is aborted.
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, outputs: OutputProcessor,
                 structured: LazyStructuredOutputs | None = None, executor: StepExecutor | None = None,
                 async_scheduling: bool = False, spec: SpecDecoder | None = None) -> None:
        """executor: how steps run on the device (default: eager, no graphs). async_scheduling: `run`
        overlaps host work with the device (core/overlap.py) instead of stepping synchronously. spec: MTP
        speculative decoding (engine/spec_decode/); its steps run synchronously while it drafts."""
        self.scheduler = scheduler
        self.runner = runner
        self.outputs = outputs
        self.structured = structured
        self.executor = executor if executor is not None else StepExecutor(runner)
        self.async_scheduling = async_scheduling
        self.overlap_stats = OverlapStats()
        self.spec = spec

    def add(self, seq: Sequence) -> None:
        """Queue a request (ValueError from the scheduler when it can never run)."""
        self.outputs.add(seq)
        if self.structured is not None:
            self.structured.add(seq)
        self.scheduler.add(seq)

    def step(self) -> list[Sequence]:
        """Run one forward pass synchronously; return the requests that finished in it."""
        if self.spec is not None and self.spec.active:
            finished = self.spec.step()
        else:
            out = self.scheduler.schedule()
            if out.is_empty:
                raise RuntimeError("scheduler produced an empty step while requests are pending")
            finished = self.scheduler.update(out, self.executor.execute(out))
        if self.structured is not None:
            for seq in finished:
                self.structured.free(seq)
        return finished

    def stats(self) -> dict[str, float | int | bool | str | list[int] | None]:
        """Counters of the loop and the device steps, and what the CUDA graphs cost at start-up."""
        o = self.overlap_stats
        return {
            "async_scheduling": self.async_scheduling,
            "overlap_steps": o.steps,
            "overlapped_steps": o.overlapped,
            "overlap_wasted_rows": o.wasted_rows,
            **self.executor.stats(),
            # Without MTP nothing is drafted or accepted (DESIGN.md contract); with it, spec_decode/policy.py.
            "spec_drafted_tokens": 0,
            "spec_accepted_tokens": 0,
            **(self.spec.stats_dict() if self.spec is not None else {}),
        }

    def abort_all(self) -> None:
        """Finish every pending request with "abort" and drop its per-request state."""
        sched = self.scheduler
        for seq in [*sched.waiting, *sched.running]:
            sched.finish(seq, "abort")
            if self.structured is not None:
                self.structured.free(seq)
            seq.detokenizer = None
            seq.block_hashes.clear()

    def run(self, on_finish: Callable[[Sequence], None], feed: RequestFeed | None = None) -> None:
        """Step until no request is pending, calling `on_finish` for each one as it finishes. `feed`: more
        requests, added as the scheduler's waiting queue runs short (core/request_feed.py) instead of all
        before the first step. MTP steps are synchronous; once drafting turns itself off the rest of the run
        takes the configured loop. The cyclic collector is kept quiet during the run (core/gc_scope.py)."""
        feed = feed if feed is not None else RequestFeed(lambda first, stop: [], 0)
        with quiet_gc():
            self._run(on_finish, feed)

    def pending(self, feed: RequestFeed) -> bool:
        """Whether a request is queued, running, or still to come from `feed`."""
        return self.scheduler.has_unfinished() or not feed.exhausted

    def _run(self, on_finish: Callable[[Sequence], None], feed: RequestFeed) -> None:
        while self.spec is not None and self.spec.active and self.pending(feed):
            feed.top_up(self)
            for seq in self.step():
                on_finish(seq)
        if self.async_scheduling:
            run_overlapped(self, on_finish, self.overlap_stats, feed)
            return
        while self.pending(feed):
            feed.top_up(self)
            for seq in self.step():
                on_finish(seq)
