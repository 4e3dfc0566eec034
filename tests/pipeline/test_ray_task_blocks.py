"""The Ray executors' part-task dataset (ray_data.blocks_dataset): one block per part, in order, with its
metadata made on the driver (ray.data.from_blocks: no remote metadata task stands between Ray being up
and the engine actors being created), on the session's shared local Ray."""

from __future__ import annotations

from deepinfer.pipeline.executors.ray_data import blocks_dataset
from deepinfer.pipeline.parts import PartTask, tasks_from_table, tasks_table

TASKS = [PartTask(part_id=f"p{i}", file_index=0, url="/in/a.jsonl", relpath="a.jsonl", first_row=3 * i,
                  num_rows=3 if i < 4 else 1) for i in range(5)]


def test_each_part_task_is_its_own_block_in_order(shared_ray) -> None:
    shared_ray.start()
    ds = blocks_dataset([tasks_table([t]) for t in TASKS])
    assert ds.num_blocks() == len(TASKS)
    blocks = list(ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0))
    assert [tasks_from_table(b) for b in blocks] == [[t] for t in TASKS]
