"""The engine loop: schedule -> execute -> update, until every request has finished."""

from __future__ import annotations

from collections.abc import Callable

from deepinfer.engine.core.scheduler import Scheduler
from deepinfer.engine.core.sequence import Sequence
from deepinfer.engine.runner.model_runner import ModelRunner
from deepinfer.engine.text.output_processor import OutputProcessor


class EngineCore:
    """Drives one model replica. Single-threaded: the scheduler and block manager are plain CPU state."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, outputs: OutputProcessor) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.outputs = outputs

    def add(self, seq: Sequence) -> None:
        self.outputs.add(seq)
        self.scheduler.add(seq)

    def step(self) -> list[Sequence]:
        """Run one forward pass; return the requests that finished in it."""
        out = self.scheduler.schedule()
        if out.is_empty:
            raise RuntimeError("scheduler produced an empty step while requests are pending")
        runner_out = self.runner.execute(out)
        finished = self.scheduler.update(out, runner_out)
        done = {id(s) for s in finished}
        by_id = {s.seq.seq_id: s.seq for s in out.sampled}
        for seq_id, token in zip(runner_out.seq_ids, runner_out.token_ids):
            seq = by_id[seq_id]
            reason = self.outputs.process(seq, token)
            if reason is not None:
                if id(seq) in done:
                    seq.finish_reason = reason   # a stop string on the last allowed token is still a stop
                else:
                    self.scheduler.finish(seq, reason)
                    finished.append(seq)
                    done.add(id(seq))
        return finished

    def abort_all(self) -> None:
        sched = self.scheduler
        for seq in [*sched.waiting, *sched.running]:
            sched.finish(seq, "abort")
            seq.extra.clear()

    def run(self, on_finish: Callable[[Sequence], None]) -> None:
        while self.scheduler.has_unfinished():
            for seq in self.step():
                on_finish(seq)
