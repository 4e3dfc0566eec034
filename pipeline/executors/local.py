"""The in-process executor: the Ray stages, called directly, with one engine (one-engine jobs, tests).

Per part, in input order: `prepare_part` (read, prompt, tokenize and length-sort per sort window), then
the engine in runtime.batch_size calls — the same steps and shapes as a Ray engine actor's task — and the
part's results are yielded at once, so the driver commits it before the next part's generation starts (a
kill loses at most the part in flight). The preparation overlaps the engine (prefetch.PartPrefetcher, one
background thread): the first part is prepared while the engine builds its model (once its modules are
imported), part N+1 while part N generates, at most `ahead` parts ahead, so the memory held stays bounded.
`ahead=0` is the strictly sequential path (prepare, then generate, on this thread), kept for debugging and
as the tests' reference. Before all this, the run's engine preload (engine_preload.py) has been opening
torch's libraries and CUDA's context since the CLI knew the run is local; `on_imported` tells it the
engine's modules are in, so that Triton's import goes beside the model build.

The engine is built and run on the consumer's thread (the driver's), the thread that generates: CUDA
graphs and the engine's own state stay on one thread. An exception while the engine builds cancels and
joins the preparing thread before it propagates; one in a part's preparation is raised here when that part
is due (after the parts before it were generated and committed, as on the sequential path).

The output bytes are identical to the Ray executor's, because every row's result is independent of its
batch (batch-invariant engine, per-row seeds) and the driver orders rows before committing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence

import pyarrow as pa
from deepinfer.pipeline.executors.prefetch import PartPrefetcher
from deepinfer.pipeline.parts import PartTask
from deepinfer.pipeline.spec.load import JobSpec
from deepinfer.pipeline.stages.generate import EngineCache
from deepinfer.pipeline.stages.plan import StagePlan, prepare_part

# Parts prepared ahead of the engine: one is enough to hide preparation (far cheaper than generating a
# part), and each more holds another part's tokenized rows in memory.
DEFAULT_AHEAD = 1


def run_local(plan: StagePlan, parts: Sequence[PartTask], engines: EngineCache | None = None,
              ahead: int = DEFAULT_AHEAD, watch: Callable[[PartPrefetcher], None] | None = None,
              on_imported: Callable[[], None] | None = None) -> Iterator[pa.Table]:
    """Yield one ENGINE_SCHEMA table per part of `parts`, in order; the LLM comes from `engines` when
    given (a sweep's points share it), else it is built for this run. `ahead`: parts prepared ahead of
    the engine (0: sequential). `watch`, when given, is called with the run's PartPrefetcher once it
    started (its counters and event let a test watch the look-ahead while the job runs). `on_imported`
    is called once the engine's modules are imported, as its model build starts (the run's
    engine_preload.EnginePreload.engine_imported: Triton's import goes beside the build)."""
    if not parts:
        return
    if ahead == 0:
        engine = plan.engine_stage(engines, on_imported=on_imported)
        for task in parts:
            yield engine.generate_part(prepare_part(plan, task), plan.batch_size)
        return
    # Held until the engine's modules are imported: those imports (torch: seconds) are Python under the
    # GIL, which a preparing thread would only slow down; the model build that follows mostly is not
    # (CUDA start, weights streamed by reader threads), so the first part is prepared beside it.
    with PartPrefetcher(functools.partial(prepare_part, plan), parts, ahead, hold=True) as prepared:
        if watch is not None:
            watch(prepared)

        def imported() -> None:
            prepared.release()
            if on_imported is not None:
                on_imported()

        engine = plan.engine_stage(engines, on_imported=imported)
        prepared.release()  # (already, as a rule: EngineStage calls it before building)
        for _ in parts:
            yield engine.generate_part(prepared.next_part(), plan.batch_size)


def engines_before_restart(spec: JobSpec) -> EngineCache | None:
    """This local run's engine, built now when `spec`'s output holds a job that --restart is about to
    delete: an engine that refuses its configuration (SpecError, exit 2) then fails while the old output
    is still whole, not after it was deleted. None when there is nothing to delete or no model runs (a
    Ray run's engines start in their actors, after the output is opened: there --restart deletes first)."""
    from deepinfer.pipeline.output import storage
    from deepinfer.pipeline.output.layout import JOB_FILE

    fs, root = storage.open_fs(spec.output.path, spec.output.storage_options)
    if spec.runtime.benchmark_stub_engine or storage.read_bytes(fs, storage.join(root, JOB_FILE)) is None:
        return None
    plan, engines = StagePlan.from_spec(spec), EngineCache()
    engines.get(plan.model_ref, plan.engine_kwargs)
    return engines
