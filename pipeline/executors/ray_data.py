"""The Ray Data executor (the product path).

Dataset plan: part descriptors -> read (task) -> prompt (task) -> tokenize + length-sort per sort window
(actors holding the tokenizer) -> streaming repartition into engine batches -> engine (one actor per
engine; num_gpus=1 each on GPU clusters) -> the driver, which iterates the results as they stream out and
commits each part when its last row is back. Each engine actor has runtime.max_batches_in_flight batches
queued so it never waits for input.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from deepinfer.pipeline.errors import SpecError
from deepinfer.pipeline.stages.plan import (
    EngineActor,
    StagePlan,
    TokenizeActor,
    part_items,
    prompt_batch,
    read_batch,
)

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


def fit_engine_cpus(engine_cpus: float, engines: int, session: RaySession, split: bool) -> float:
    """CPUs per engine actor, lowered when the actors would leave nothing for the CPU stages (which
    would stall the pipeline forever on a small machine). The CPU stages need one read/prompt task and one
    tokenizer actor at least, plus one whole CPU for the batch splitter when there are several engines."""
    spare = session.num_cpus - 2 * _LIGHT_CPUS - (1.0 if split else 0.0)
    if engines * engine_cpus <= spare:
        return engine_cpus
    fitted = max(spare / engines, 0.01)
    print(f"[deepinfer] runtime.engine_cpus={engine_cpus} x {engines} engines does not fit the cluster's "
          f"{session.num_cpus:g} CPUs beside the CPU stages; using {fitted:.2f} CPUs per engine",
          file=sys.stderr)
    return fitted


def run_ray(plan: StagePlan, parts: list[dict[str, Any]], session: RaySession, engines: int | None,
            engine_cpus: float, max_batches_in_flight: int) -> Iterator[pa.Table]:
    """Yield ENGINE_SCHEMA tables as the engines finish batches (no order guarantee)."""
    import ray.data

    if not parts:
        return
    use_gpu = uses_gpus(plan, session)
    engines = engine_count(engines, session, use_gpu)
    split = engines > 1
    engine_cpus = fit_engine_cpus(engine_cpus, engines, session, split)
    ds = ray.data.from_items(part_items(parts), override_num_blocks=len(parts))
    ds = ds.map_batches(read_batch, fn_kwargs={"plan": plan}, batch_size=1, batch_format="pyarrow",
                        num_cpus=_LIGHT_CPUS)
    ds = ds.map_batches(prompt_batch, fn_kwargs={"plan": plan}, batch_size=None, batch_format="pyarrow",
                        num_cpus=_LIGHT_CPUS)
    ds = ds.map_batches(TokenizeActor, fn_constructor_kwargs={"plan": plan}, batch_size=plan.sort_window,
                        batch_format="pyarrow", num_cpus=_LIGHT_CPUS,
                        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=max(1, engines)))
    if split:
        # A sort window leaves the tokenizer as one block and Ray Data hands whole blocks to actor tasks:
        # cut it (in order, streaming) into engine batches so that every engine gets work. (Ray runs this
        # splitter as tasks of one CPU each; fit_engine_cpus keeps that CPU free.)
        ds = ds.repartition(target_num_rows_per_block=plan.batch_size)
    ds = ds.map_batches(
        EngineActor, fn_constructor_kwargs={"plan": plan}, batch_size=plan.batch_size, batch_format="pyarrow",
        num_gpus=1 if use_gpu else 0, num_cpus=engine_cpus,
        compute=ray.data.ActorPoolStrategy(size=engines, max_tasks_in_flight_per_actor=max_batches_in_flight),
    )
    yield from ds.iter_batches(batch_size=None, batch_format="pyarrow")
