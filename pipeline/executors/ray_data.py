"""The Ray Data executor (the product path). pipeline/ROWFLOW.md tells the whole row flow.

Dataset plan, one block per part all the way: part tasks (PART_TASK_SCHEMA, one one-row block each) ->
prepare (a task per part: read, prompt, tokenize, length-sort per sort window; fused by Ray Data; its
output is one packed row per part, stages/packed_parts.py) -> engine (an actor pool of runtime.engines
actors, num_gpus=1 each on GPU clusters, mapped with batch_size=1; each call takes one whole part,
runs it in runtime.batch_size engine calls and commits it from where it ran: see output/worker_commit.py)
-> the driver, which streams the parts' reports with iter_batches as engines commit them, counting
progress and the summary. Each engine actor has at
most runtime.max_batches_in_flight parts queued, so a kill loses at most engines x that many parts, and
the driver never holds more than the few result blocks it is committing. The actor pool starts its
actors (and they build their models) while the first parts are read and tokenized.

On a cluster of several nodes (`--address` / $RAY_ADDRESS) the engine actors are spread over the nodes
that have the resources (SPREAD; one per GPU, or one CPU engine per node when runtime.engines is null),
workers read their parts from the input's storage and commit them to the output's storage. The first
block is dispatched once every engine is up (when they all fit the cluster), so that the parts are
spread over all of them rather than taken by whichever engine built its model first. Nothing may assume
the driver's disk is visible to workers, so local input/output paths are refused there (exit 2) unless
runtime.shared_filesystem says they are shared (`check_cluster_storage`). A lost worker node costs its
parts in flight: Ray Data retries the tasks and restarts the engine actors elsewhere (max_restarts=-1);
if the run fails instead, it exits 75 and the rerun recomputes only uncommitted parts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
from deepinfer.pipeline.errors import SpecError
from deepinfer.pipeline.output.worker_commit import CommitTarget
from deepinfer.pipeline.parts import PartTask, tasks_table
from deepinfer.pipeline.stages import columns as C
from deepinfer.pipeline.stages.packed_parts import unpack_parts
from deepinfer.pipeline.stages.plan import EngineActor, StagePlan, prepare_batch
from deepinfer.pipeline.worker_errors import in_worker

if TYPE_CHECKING:
    import ray.data

# Light CPU stages ask for a fraction of a core so that they always fit beside the actors that hold cores.
_LIGHT_CPUS = 0.25


@dataclass
class RaySession:
    """A Ray connection for one run; `owned` when this process started the local Ray (and stops it).

    `node_cpus`: the CPUs of each alive node that has CPUs or GPUs (a head node started with
    num_cpus=0 to hold only the driver is not counted); `client`: attached through Ray Client
    (ray://), so the driver is not on any node of the cluster.
    """

    owned: bool
    num_gpus: int
    num_cpus: float
    node_cpus: tuple[float, ...] = (1.0,)
    client: bool = False

    @property
    def multi_node(self) -> bool:
        """Whether workers may run where the driver's local disk is not (several nodes, or Ray Client)."""
        return self.client or len(self.node_cpus) > 1

    def close(self) -> None:
        if self.owned:
            import ray

            _kill_monitor()
            ray.shutdown()


def _kill_monitor() -> None:
    """SIGKILL the local cluster's autoscaler monitor before ray.shutdown: shutdown stops the head
    processes one at a time, each given 1 s to exit on SIGTERM, and the monitor (which holds no state
    a finished local run needs) uses all of it, ~1 s of every submit's exit. The raylet is left to
    shutdown's graceful stop: it takes its workers and agents down (killed abruptly, agents outlive it).
    Best effort through Ray's private node handle; without it, shutdown behaves as it always did."""
    try:
        from ray._private import ray_constants, worker

        node = worker._global_node
        for info in (node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, []) if node else []):
            if info.process.poll() is None:
                info.process.kill()
                info.process.wait(timeout=1)
    except Exception:  # noqa: BLE001 - a Ray without these internals: plain ray.shutdown
        pass


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
            # "local": no address means a Ray of this run's own, as attaches_to_cluster says; left None,
            # Ray would attach to a cluster a `ray start` left on this machine (its address file).
            ray.init(address=address or "local", logging_level=level, log_to_driver=verbose,
                     include_dashboard=False, configure_logging=True)
        owned = address is None
    configure_data_context(verbose)
    resources = ray.cluster_resources()
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    node_cpus = tuple(float(r.get("CPU", 0)) for r in nodes if r.get("CPU", 0) > 0 or r.get("GPU", 0) > 0)
    client = str(address or os.environ.get("RAY_ADDRESS") or "").startswith("ray://")
    return RaySession(owned, int(resources.get("GPU", 0)), float(resources.get("CPU", 1)),
                      node_cpus or (float(resources.get("CPU", 1)),), client)


def attaches_to_cluster(address: str | None) -> bool:
    """Whether a Ray run would attach to an existing cluster (else it starts a local, one-node Ray)."""
    if address or os.environ.get("RAY_ADDRESS"):
        return True
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def is_local_path(path: str) -> bool:
    """A path on the driver's own filesystem (no URL scheme, or file://)."""
    return "://" not in path or path.lower().startswith(("file://", "local://"))


def storage_problems(input_path: str, output_path: str, shared_filesystem: bool,
                     session: RaySession) -> list[str]:
    """Why this job cannot run on `session`'s cluster as it is (empty when it can): on several nodes,
    local input and output paths must be declared shared (runtime.shared_filesystem)."""
    if not session.multi_node or shared_filesystem:
        return []
    where = ("the driver attaches through Ray Client (ray://) and is on none of the cluster's nodes"
             if session.client else f"the Ray cluster has {len(session.node_cpus)} nodes")
    problems = []
    for field, path in (("input.path", input_path), ("output.path", output_path)):
        if is_local_path(path):
            problems.append(
                f"{field}: {path} is a local path, but {where}: workers read input and resumed runs may "
                "commit from another node, so nothing may assume the driver's disk is visible to them. "
                "Use s3://bucket/prefix, or set runtime.shared_filesystem: true if this path is on "
                "storage every node mounts at the same path")
    return problems


def check_cluster_storage(input_path: str, output_path: str, shared_filesystem: bool,
                          address: str | None, verbose: bool) -> None:
    """Before anything is written: refuse (SpecError, exit 2) local paths on a multi-node cluster.

    Connects only when the run attaches to an existing cluster; a local Ray started by this run is
    one node, the driver's own.
    """
    if not attaches_to_cluster(address):
        return
    problems = storage_problems(input_path, output_path, shared_filesystem, connect(address, verbose))
    if problems:
        raise SpecError(problems)


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


def engine_count(requested: int | None, session: RaySession, use_gpu: bool, gpus_per_engine: int = 1) -> int:
    """runtime.engines, else one engine per `gpus_per_engine` GPUs, else one CPU engine per node."""
    if requested is not None:
        return requested
    return max(1, session.num_gpus // gpus_per_engine) if use_gpu else max(1, len(session.node_cpus))


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
    # An actor larger than every node can never be placed: the run would wait forever.
    largest = max(session.node_cpus, default=session.num_cpus)
    if fitted > largest - _LIGHT_CPUS and largest > _LIGHT_CPUS:
        fitted = largest - _LIGHT_CPUS
        print(f"[deepinfer] runtime.engine_cpus={engine_cpus} exceeds the largest node's {largest:g} CPUs "
              f"beside the CPU stages; using {fitted:.2f} CPUs per engine", file=sys.stderr)
    # Ray Data fuses map stages with equal resource requests; the engine must stay its own stage (else
    # each engine actor would read and tokenize its parts itself, serially).
    return fitted if abs(fitted - _LIGHT_CPUS) > 1e-6 else fitted * 0.99


# How long a run waits for all its engines to start before giving up (exit 75): model loads included.
ENGINE_START_TIMEOUT_S = 1800


def engines_fit(engines: int, engine_cpus: float, gpus_per_engine: int, use_gpu: bool,
                session: RaySession) -> bool:
    """Whether all `engines` can run at once on the cluster as it is (else the run starts with those
    that fit, and Ray places the rest when resources free up)."""
    if use_gpu:
        return engines * gpus_per_engine <= session.num_gpus
    per_node = [int((cpus - _LIGHT_CPUS) // engine_cpus) if engine_cpus > 0 else engines
                for cpus in session.node_cpus]
    return sum(max(n, 0) for n in per_node) >= engines


def run_ray(plan: StagePlan, parts: Sequence[PartTask], session: RaySession,
            settings: EngineSettings, target: CommitTarget | None = None) -> Iterator[pa.Table]:
    """Yield ENGINE_SCHEMA tables, one per part as a rule, as the engines finish them (no order); with
    `target`, the engine actors commit each part themselves and yield REPORT_SCHEMA reports."""
    if not parts:
        return
    ds = engine_dataset(plan, parts, session, settings, target)
    yield from ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0)


def engine_dataset(plan: StagePlan, parts: Sequence[PartTask], session: RaySession,
                   settings: EngineSettings, target: CommitTarget | None = None) -> ray.data.Dataset:
    """The (lazy) dataset of `run_ray`: part tasks -> prepare -> engine actors; nothing runs until it is
    iterated."""
    import ray.data

    use_gpu = uses_gpus(plan, session)
    engines = engine_count(settings.engines, session, use_gpu,
                           plan.engine_kwargs.get("tensor_parallel_size", 1))
    engine_cpus = fit_engine_cpus(settings.engine_cpus, engines, session)
    tp = plan.engine_kwargs.get("tensor_parallel_size", 1)
    ctx = ray.data.DataContext.get_current()
    # Ray Data hands blocks to whichever actor is up: without this wait, on a slow start (a large model,
    # a busy node) the first engine ready takes every part of a short job and the others idle.
    ctx.wait_for_min_actors_s = (ENGINE_START_TIMEOUT_S if engines > 1 and
                                 engines_fit(engines, engine_cpus, tp, use_gpu, session) else -1)
    # One block per part, batch_size=None for prepare (a batch is a whole block) and one packed row per
    # part into the engines, mapped with batch_size=1 (stages/packed_parts.py; Ray Data refuses None
    # with GPUs): Ray Data then never merges or splits parts, so each part's results come back, and are
    # committed, on their own.
    ds = blocks_dataset([tasks_table([task]) for task in parts])
    # At most one prepare task per engine at a time: preparing a part is far cheaper than generating it,
    # and unbounded read-ahead (4 tasks per spare CPU at 0.25 CPU each) would take the cores a CPU
    # engine needs, delaying the first commits for work that is not needed yet.
    ds = ds.map_batches(prepare_batch, fn_kwargs={"plan": plan}, batch_size=None, batch_format="pyarrow",
                        num_cpus=_LIGHT_CPUS, concurrency=engines)
    # Placement: Ray Data creates pool actors with its SPREAD default (DataContext.scheduling_strategy;
    # an explicit scheduling_strategy is deprecated there), so engines go to different nodes first.
    ds = ds.map_batches(
        NodeEngineActor, fn_constructor_kwargs={"plan": plan, "target": target}, batch_size=1,
        batch_format="pyarrow",
        # A tensor-parallel engine (model.tensor_parallel_size) spans that many GPUs of one node.
        num_gpus=tp if use_gpu else 0, num_cpus=engine_cpus,
        compute=ray.data.ActorPoolStrategy(size=engines,
                                           max_tasks_in_flight_per_actor=settings.max_batches_in_flight),
    )
    return ds


def blocks_dataset(tables: list[pa.Table]) -> ray.data.Dataset:
    """A dataset of exactly these blocks, in order. ray.data.from_blocks computes the blocks' metadata
    here; from_arrow (the fallback, for a Ray without from_blocks) runs a remote task per block for it
    and waits, seconds on a Ray just started (its workers still importing Ray Data), all before the
    engine actors can be created."""
    import ray.data

    from_blocks = getattr(ray.data, "from_blocks", None)
    return from_blocks(tables) if from_blocks is not None else ray.data.from_arrow(tables)


class NodeEngineActor(EngineActor):
    """The engine actor of a Ray run: its engine id (run summary, per-engine figures) names its node,
    since simulated or containerised nodes may share one hostname. With a `target` it commits each part
    it generated (output/worker_commit.py) and returns the part's report instead of its rows."""

    @in_worker
    def __init__(self, plan: StagePlan, target: CommitTarget | None = None) -> None:
        super().__init__(plan)
        import ray

        self.stage.engine_id = f"{self.stage.engine_id}@{ray.get_runtime_context().get_node_id()[:12]}"
        self.committer = None
        if target is not None:
            from deepinfer.pipeline.output.worker_commit import PartCommitter

            self.committer = PartCommitter(target, self.stage.engine_id)
        self.stage.mark_ready()

    @in_worker
    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = unpack_parts(batch, C.TOKENIZE_SCHEMA)
        if self.committer is None:
            return self.stage.generate_part(rows, self.batch_size)
        self.committer.starting(rows)
        return self.stage.generate_part(rows, self.batch_size, finish=self.committer.commit)
