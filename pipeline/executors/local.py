"""The in-process executor: the Ray stages, called directly, with one engine (tests and tiny jobs).

Part by part, in input order: `prepare_part` (read, prompt, tokenize and length-sort per sort window),
then the engine in runtime.batch_size calls — the same steps and shapes as a Ray engine actor's task —
and the part's results are yielded at once, so the driver commits it before the next part starts.
The output bytes are identical to the Ray executor's, because every row's result is independent of its
batch (batch-invariant engine, per-row seeds) and the driver orders rows before committing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pyarrow as pa
from deepinfer.pipeline.parts import PartTask
from deepinfer.pipeline.stages.generate import EngineCache
from deepinfer.pipeline.stages.plan import StagePlan, prepare_part


def run_local(plan: StagePlan, parts: Sequence[PartTask], engines: EngineCache | None = None
              ) -> Iterator[pa.Table]:
    """Yield one ENGINE_SCHEMA table per part of `parts`, in order; the LLM comes from `engines` when
    given (a sweep's points share it), else it is built for this run."""
    if not parts:
        return
    engine = plan.engine_stage(engines)
    for task in parts:
        yield engine.generate_part(prepare_part(plan, task), plan.batch_size)
