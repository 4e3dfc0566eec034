"""The Ray executor for a group of sweep points that share one engine: one Ray Data pipeline, one actor pool.

The points of a sweep that ask for the same model and engine settings (StagePlan.engine_key) and the same
runtime engine settings run through one dataset: every point's part tasks, each tagged with its point
(``<point key>|<part id>`` in the part id, the only field that travels as a label), go through the same
prepare stage (each with its point's plan) and the same engine actors. Each actor builds the model once
(one EngineCache) and keeps one EngineStage per point over it, so each point samples with its own
settings and seeds. The driver strips the tag and hands each part's rows to its point's job
(sweep_run.py), which commits it exactly as a job run alone would; a row's result does not depend on the
other rows sharing its engine (batch-invariant engine, per-row seeds), so a point's bytes are the same
as running it alone.

The plan and placement rules are ray_data.run_ray's (one block per part, one prepare task per engine in
flight, SPREAD actors, engine_cpus fitted to the cluster).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
from deepinfer.pipeline.executors.ray_data import (
    _LIGHT_CPUS,
    EngineSettings,
    RaySession,
    blocks_dataset,
    engine_count,
    fit_engine_cpus,
    uses_gpus,
)
from deepinfer.pipeline.parts import PartTask, tasks_from_table, tasks_table
from deepinfer.pipeline.stages import columns as C
from deepinfer.pipeline.stages.packed_parts import pack_parts, unpack_parts
from deepinfer.pipeline.stages.plan import StagePlan, prepare_part
from deepinfer.pipeline.worker_errors import in_worker

TAG_SEP = "|"  # never in a part id (parts.PART_ID_RE) nor in a point key (sweep_run uses indices)


if TYPE_CHECKING:
    import ray.data


def tag_part(key: str, part_id: str) -> str:
    return f"{key}{TAG_SEP}{part_id}"


def split_tag(tagged: str) -> tuple[str, str]:
    key, _, part_id = tagged.partition(TAG_SEP)
    return key, part_id


@in_worker
def prepare_point_batch(batch: pa.Table, plans: Mapping[str, StagePlan]) -> pa.Table:
    """Ray Data task stage: tagged PART_TASK_SCHEMA rows -> one packed row of tokenized rows per part,
    each prepared with its point's plan (the tag stays in __part for the engine and the driver)."""
    tasks = tasks_from_table(batch)
    return pack_parts(prepare_part(plans[split_tag(task.part_id)[0]], task) for task in tasks)


def by_point(table: pa.Table) -> list[tuple[str, pa.Table]]:
    """(point key, rows with the tag taken out of __part) per point present in `table`."""
    tagged = table.column("__part")
    present = sorted(pc.unique(tagged).to_pylist())
    out = []
    for value in present:  # one part per block as a rule: then the table is taken whole
        key, part_id = split_tag(value)
        rows = table if len(present) == 1 else table.filter(pc.equal(tagged, value))
        index = rows.schema.get_field_index("__part")
        rows = rows.set_column(index, rows.schema.field(index), pa.array([part_id] * rows.num_rows,
                                                                          pa.string()))
        out.append((key, rows))
    return out


class SweepEngineActor:
    """One engine actor of a point group: the model built once, one EngineStage per point over it.

    Its engine id (host:pid@node, as NodeEngineActor's) is on every row it returns, so each point's run
    summary names the engines that served it: one pool for the group shows as the same ids in every point.
    """

    @in_worker
    def __init__(self, plans: Mapping[str, StagePlan]) -> None:
        import ray
        from deepinfer.pipeline.stages.generate import EngineCache

        self.cache = EngineCache()
        node = ray.get_runtime_context().get_node_id()[:12]
        self.stages = {}
        for key, plan in plans.items():
            stage = plan.engine_stage(self.cache)
            stage.engine_id = f"{stage.engine_id}@{node}"
            self.stages[key] = (stage, plan.batch_size)

    @in_worker
    def __call__(self, batch: pa.Table) -> pa.Table:
        batch = unpack_parts(batch, C.TOKENIZE_SCHEMA)
        results = []
        present = sorted(pc.unique(batch.column("__part")).to_pylist())
        for value in present:
            rows = batch if len(present) == 1 else batch.filter(pc.equal(batch.column("__part"), value))
            stage, batch_size = self.stages[split_tag(value)[0]]
            results.append(stage.generate_part(rows, batch_size))
        return pa.concat_tables(results) if results else C.ENGINE_SCHEMA.empty_table()


def run_ray_group(plans: Mapping[str, StagePlan], parts: Mapping[str, Sequence[PartTask]],
                  session: RaySession, settings: EngineSettings) -> Iterator[tuple[str, pa.Table]]:
    """Yield (point key, ENGINE_SCHEMA rows of one of its parts) as the shared engines finish them.

    `plans` must share one StagePlan.engine_key (sweep_run groups them so); `parts` are each point's
    parts still to run.
    """
    tagged = [replace(t, part_id=tag_part(key, t.part_id)) for key in plans for t in parts.get(key, ())]
    if not tagged:
        return
    ds = group_dataset(plans, tagged, session, settings)
    for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0):
        yield from by_point(batch)


def group_dataset(plans: Mapping[str, StagePlan], tagged: Sequence[PartTask], session: RaySession,
                  settings: EngineSettings) -> ray.data.Dataset:
    """The (lazy) dataset of `run_ray_group` over its tagged part tasks."""
    import ray.data

    first = next(iter(plans.values()))
    if len({p.engine_key() for p in plans.values()}) != 1:
        raise ValueError("run_ray_group: the plans do not share one engine; group them by engine_key")
    use_gpu = uses_gpus(first, session)
    tp = first.engine_kwargs.get("tensor_parallel_size", 1)
    engines = engine_count(settings.engines, session, use_gpu, tp)
    engine_cpus = fit_engine_cpus(settings.engine_cpus, engines, session)
    ds = blocks_dataset([tasks_table([task]) for task in tagged])
    ds = ds.map_batches(prepare_point_batch, fn_kwargs={"plans": dict(plans)}, batch_size=None,
                        batch_format="pyarrow", num_cpus=_LIGHT_CPUS, concurrency=engines)
    ds = ds.map_batches(
        SweepEngineActor, fn_constructor_kwargs={"plans": dict(plans)}, batch_size=1,
        batch_format="pyarrow", num_gpus=tp if use_gpu else 0, num_cpus=engine_cpus,
        compute=ray.data.ActorPoolStrategy(size=engines,
                                           max_tasks_in_flight_per_actor=settings.max_batches_in_flight),
    )
    return ds
