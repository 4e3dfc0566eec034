"""The Ray Data executor (the product path). pipeline/ROWFLOW.md tells the whole row flow.

Dataset plan, one block per part all the way: part tasks (PART_TASK_SCHEMA, one one-row block each) ->
prepare (a task per part: read, prompt, tokenize, length-sort per sort window; fused by Ray Data) ->
engine (an actor pool of runtime.engines actors, num_gpus=1 each on GPU clusters; each call takes one
whole part and runs it in runtime.batch_size engine calls) -> the driver, which streams the result
blocks with iter_batches as engines finish them and commits each part at once. Each engine actor has at
most runtime.max_batches_in_flight parts queued, so a kill loses at most engines x that many parts, and
the driver never holds more than the few result blocks it is committing. The actor pool starts its
actors (and they build their models) while the first parts are read and tokenized.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pyarrow as pa
from deepinfer.pipeline.errors import SpecError
from deepinfer.pipeline.parts import PartTask, tasks_table
from deepinfer.pipeline.stages.plan import EngineActor, StagePlan, prepare_batch

# Light CPU stages ask for a fraction of a core so that they always fit beside the actors that hold cores.
_LIGHT_CPUS = 0.25


@dataclass
class RaySession:
    """A Ray connection for one run; `owned` when this process started the local Ray (and stops it)."""

    owned: bool
    num_gpus: int
    num_cpus: float

    def close(self) -> None:
        if self.owned:
            import ray

            ray.shutdown()


def connect(address: str | None, verbose: bool) -> RaySession:
    """Attach to `address` / $RAY_ADDRESS, or start a local Ray; quiet unless verbose."""
    import ray

    owned = False
    if not verbose:
        # The C++ core worker logs at ERROR level for conditions Ray Data handles (e.g. actor constructor
        # arguments kept in the object store); users see deepinfer's own messages instead.
        os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS") or None
        level = logging.INFO if verbose else logging.ERROR
        with _quiet_stderr(not verbose):
            ray.init(address=address, logging_level=level, log_to_driver=verbose, include_dashboard=False,
                     configure_logging=True)
        owned = address is None
    configure_data_context(verbose)
    resources = ray.cluster_resources()
    return RaySession(owned, int(resources.get("GPU", 0)), float(resources.get("CPU", 1)))


@contextlib.contextmanager
def _quiet_stderr(enabled: bool) -> Iterator[None]:
    """Hold back the C++ start-up chatter Ray writes straight to file descriptor 2 during ray.init
    (e.g. 'Set ray log level from environment variable'); anything else is written out afterwards."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as buf:
        os.dup2(buf.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            buf.seek(0)
            for line in buf.read().decode("utf-8", "replace").splitlines(keepends=True):
                if "Set ray log level from environment variable" not in line:
                    sys.stderr.write(line)


def configure_data_context(verbose: bool) -> None:
    """Ray Data's own progress bars and INFO logs are replaced by deepinfer's display unless -v."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = verbose
    ctx.enable_operator_progress_bars = verbose
    ctx.verbose_stats_logs = verbose
    ctx.enable_auto_log_stats = verbose
    if hasattr(ctx, "print_on_execution_start"):
        ctx.print_on_execution_start = verbose
    for name in ("ray.data", "ray"):
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.ERROR)


def uses_gpus(plan: StagePlan, session: RaySession) -> bool:
    """Engines take one GPU each when the cluster has GPUs, unless the spec pins model.device: cpu."""
    device = plan.engine_kwargs.get("device", "auto")
    if device == "cuda" and session.num_gpus == 0:
        raise SpecError(["model.device: 'cuda' but the Ray cluster has no GPUs (use 'auto' or 'cpu')"])
    return session.num_gpus > 0 and device != "cpu"


def engine_count(requested: int | None, session: RaySession, use_gpu: bool) -> int:
    """runtime.engines, else one engine per GPU, else a single CPU engine."""
    if requested is not None:
        return requested
    return max(1, session.num_gpus) if use_gpu else 1


@dataclass(frozen=True)
class EngineSettings:
    """The runtime section's engine settings (runtime.engines, engine_cpus, max_batches_in_flight)."""

    engines: int | None
    engine_cpus: float
    max_batches_in_flight: int


def fit_engine_cpus(engine_cpus: float, engines: int, session: RaySession) -> float:
    """CPUs per engine actor, lowered when the actors would leave nothing for the CPU stages (which
    would stall the pipeline forever on a small machine): one prepare task must always fit beside them."""
    spare = session.num_cpus - _LIGHT_CPUS
    fitted = engine_cpus
    if engines * engine_cpus > spare:
        fitted = max(spare / engines, 0.01)
        print(f"[deepinfer] runtime.engine_cpus={engine_cpus} x {engines} engines does not fit the cluster's "
              f"{session.num_cpus:g} CPUs beside the CPU stages; using {fitted:.2f} CPUs per engine",
              file=sys.stderr)
    # Ray Data fuses map stages with equal resource requests; the engine must stay its own stage (else
    # each engine actor would read and tokenize its parts itself, serially).
    return fitted if abs(fitted - _LIGHT_CPUS) > 1e-6 else fitted * 0.99


def run_ray(plan: StagePlan, parts: Sequence[PartTask], session: RaySession,
            settings: EngineSettings) -> Iterator[pa.Table]:
    """Yield ENGINE_SCHEMA tables, one per part as a rule, as the engines finish them (no order)."""
    import ray.data

    if not parts:
        return
    use_gpu = uses_gpus(plan, session)
    engines = engine_count(settings.engines, session, use_gpu)
    engine_cpus = fit_engine_cpus(settings.engine_cpus, engines, session)
    # One block per part, and batch_size=None below (a batch is a whole block): Ray Data then never
    # merges parts into one task, so each part's results come back, and are committed, on their own.
    ds = ray.data.from_arrow([tasks_table([task]) for task in parts])
    # At most one prepare task per engine at a time: preparing a part is far cheaper than generating it,
    # and unbounded read-ahead (4 tasks per spare CPU at 0.25 CPU each) would take the cores a CPU
    # engine needs, delaying the first commits for work that is not needed yet.
    ds = ds.map_batches(prepare_batch, fn_kwargs={"plan": plan}, batch_size=None, batch_format="pyarrow",
                        num_cpus=_LIGHT_CPUS, concurrency=engines)
    ds = ds.map_batches(
        EngineActor, fn_constructor_kwargs={"plan": plan}, batch_size=None, batch_format="pyarrow",
        num_gpus=1 if use_gpu else 0, num_cpus=engine_cpus,
        compute=ray.data.ActorPoolStrategy(size=engines,
                                           max_tasks_in_flight_per_actor=settings.max_batches_in_flight),
    )
    yield from ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0)
