"""A prepared part crosses to the engine actors as one packed row (pipeline/stages/packed_parts.py), and the
Ray dataset of a job is a plan Ray Data accepts on a GPU cluster, not only on CPUs.

Ray Data refuses `batch_size=None` for a stage that asks for GPUs, which only shows when a job is built for
a cluster with GPUs: the plan is built here against the session's local Ray with a RaySession that says
the cluster has GPUs (building is lazy: nothing is scheduled, so no GPU is needed to check it).
"""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest
from deepinfer.pipeline.parts import PartTask
from deepinfer.pipeline.stages import columns as C
from deepinfer.pipeline.stages.packed_parts import PACKED_SCHEMA, pack_parts, unpack_parts
from deepinfer.pipeline.stages.plan import StagePlan

TABLES = {
    "one part": [pa.table({"a": [1, 2, 3], "b": ["x", "y", None]})],
    "two parts": [pa.table({"a": [1], "b": ["x"]}), pa.table({"a": [4, 5], "b": ["z", "w"]})],
    "an empty part": [pa.table({"a": pa.array([], pa.int64()), "b": pa.array([], pa.string())})],
    "nested columns": [pa.table({"ids": [[1, 2], [3]], "m": [{"k": 1.5}, {"k": None}]})],
}


@pytest.mark.parametrize("name", sorted(TABLES))
def test_packing_gives_one_row_per_part_and_unpacking_gives_the_rows_back(name: str) -> None:
    tables = TABLES[name]
    packed = pack_parts(tables)
    assert packed.schema == PACKED_SCHEMA and packed.num_rows == len(tables)
    assert unpack_parts(packed, tables[0].schema).equals(pa.concat_tables(tables))
    for i, table in enumerate(tables):  # each row alone is its part, as the engine stage receives it
        assert unpack_parts(packed.slice(i, 1), table.schema).equals(table)


def test_no_packed_rows_unpack_to_the_empty_schema() -> None:
    empty = C.TOKENIZE_SCHEMA.empty_table()
    assert unpack_parts(PACKED_SCHEMA.empty_table(), C.TOKENIZE_SCHEMA).equals(empty)


def test_unpacking_rows_that_are_not_packed_parts_says_what_it_got() -> None:
    with pytest.raises(ValueError, match=r"packed parts.*got columns \['a', 'b'\]"):
        unpack_parts(TABLES["one part"][0], C.TOKENIZE_SCHEMA)


def _plan(tp: int) -> StagePlan:
    return StagePlan(input_format="jsonl", input_storage_options={}, template="{{ text }}", system=None,
                     mode="raw", chat_date="", id_column=None, output_id_column="id", keep_columns=(),
                     model_ref="demo", engine_kwargs={"tensor_parallel_size": tp}, max_model_len=None,
                     sampling_kwargs={}, job_seed=0, output_schema=None, batch_size=8, sort_window=0)


TASKS = [PartTask(part_id=f"p{i}", file_index=0, url="/in/a.jsonl", relpath="a.jsonl", first_row=4 * i,
                  num_rows=4) for i in range(3)]


@pytest.mark.parametrize("gpus, tp", [(1, 1), (4, 1), (4, 2), (0, 1)])
def test_the_job_dataset_is_a_plan_ray_data_accepts_with_and_without_gpus(shared_ray, gpus: int,
                                                                         tp: int) -> None:
    from deepinfer.pipeline.executors.ray_data import EngineSettings, RaySession, engine_dataset
    from deepinfer.pipeline.executors.sweep_ray import group_dataset, tag_part

    shared_ray.start()
    session = RaySession(owned=False, num_gpus=gpus, num_cpus=8.0, node_cpus=(8.0,))
    settings = EngineSettings(engines=None, engine_cpus=1.0, max_batches_in_flight=1)
    assert engine_dataset(_plan(tp), TASKS, session, settings) is not None
    plans = {"pt": _plan(tp)}
    tagged = [dataclasses.replace(t, part_id=tag_part("pt", t.part_id)) for t in TASKS]
    assert group_dataset(plans, tagged, session, settings) is not None
