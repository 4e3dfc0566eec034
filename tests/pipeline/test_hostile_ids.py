"""Ids of mixed types and duplicate ids (defects 1 and 5).

A job whose id column mixes integers and strings completes, with a string id column whose type does not
depend on the part; of rows sharing an id (7 and "7" included) the first in input order (sorted file
paths, then row order) is processed and every later one is quarantined once as DUPLICATE_ID, within a
file and across files, counted against the error budget — also when the id pass spills to disk.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from deepinfer.pipeline.cli.main import main
from deepinfer.pipeline.parts import PartTask, tasks_from_table, tasks_table
from deepinfer.pipeline.stages.assemble import PartAssembler
from deepinfer.pipeline.stages.dedupe import find_duplicates, with_duplicates
from deepinfer.pipeline.stages.read import list_input

from tests.support.pipeline_helpers import read_parts, write_jsonl, write_spec


def _inputs(root: Path) -> Path:
    """Two files; ids repeat within a.jsonl (7 / "7" / 7) and across files ("x", 3)."""
    write_jsonl(root / "in" / "a.jsonl", [
        {"rid": 7, "t": "a0"}, {"rid": "x", "t": "a1"}, {"rid": "7", "t": "a2"}, {"rid": 3, "t": "a3"},
        {"rid": 7, "t": "a4"}, {"rid": "y", "t": "a5"}])
    write_jsonl(root / "in" / "b.jsonl", [
        {"rid": "x", "t": "b0"}, {"rid": 11, "t": "b1"}, {"rid": "3", "t": "b2"}, {"rid": "z", "t": "b3"}])
    return root / "in"


@pytest.mark.parametrize("max_in_memory", [1_000_000, 2])  # 2: five hash partitions spilled to disk
def test_duplicates_are_later_rows_in_input_order(tmp_path: Path, max_in_memory: int) -> None:
    listing = list_input(str(_inputs(tmp_path)), "jsonl")
    found = find_duplicates(listing, "jsonl", "rid", max_in_memory=max_in_memory)
    assert found == {0: [2, 4], 1: [0, 2]}


def test_duplicate_rows_travel_with_their_part_task() -> None:
    tasks = [PartTask("00000-0000000000", 0, "u", "a", 0, 3), PartTask("00000-0000000003", 0, "u", "a", 3, 3)]
    marked = with_duplicates(tasks, {0: [1, 4, 5]})
    assert [t.duplicates for t in marked] == [(1,), (4, 5)]
    assert tasks_from_table(tasks_table(marked)) == marked


def test_mixed_id_types_assemble_into_a_string_column() -> None:
    from deepinfer.pipeline.stages import columns as C

    rows = [{"__file": 0, "__row": i, "__err_stage": None, "__keep": C.dumps({"rid": v}), "__text": "t",
             "__finish": "stop", "__plen": 1, "__ntok": 1, "__seed": 1, "__json": None}
            for i, v in enumerate([7, "x", 8])]
    table = pa.Table.from_pylist(rows)
    # Even a type that does not fit (int64 from a sample) never crashes the part: canonical text.
    ok, errors = PartAssembler("rid", False, (), None, {"rid": pa.int64()}).build(table)
    assert ok.column("rid").to_pylist() == ["7", "x", "8"] and ok.schema.field("rid").type == pa.string()
    ok, _ = PartAssembler("rid", False, (), None, {"rid": pa.string()}).build(table)
    assert ok.column("rid").to_pylist() == ["7", "x", "8"] and errors.num_rows == 0


def test_mixed_and_duplicate_ids_end_to_end(tmp_path: Path, tiny_checkpoint, capsys) -> None:
    spec = write_spec(tmp_path / "job.yaml", {
        "model": {"path": str(tiny_checkpoint("llama"))},
        "input": {"path": str(_inputs(tmp_path)), "format": "jsonl", "id_column": "rid"},
        "prompt": {"mode": "raw", "template": "{{ t }}"},
        "sampling": {"max_tokens": 2, "seed": 3},
        "output": {"path": str(tmp_path / "out"), "format": "parquet"},
        "runtime": {"executor": "local", "rows_per_part": 3, "max_error_fraction": 0.5},
    })
    assert main(["submit", spec]) == 0, capsys.readouterr().err
    rows, errors = read_parts(tmp_path / "out"), read_parts(tmp_path / "out", "errors")
    assert rows.schema.field("rid").type == pa.string()
    assert rows.column("rid").to_pylist() == ["7", "x", "3", "y", "11", "z"]
    assert sorted(zip(errors.column("id").to_pylist(), errors.column("code").to_pylist())) == [
        ("3", "DUPLICATE_ID"), ("7", "DUPLICATE_ID"), ("7", "DUPLICATE_ID"), ("x", "DUPLICATE_ID")]
    summary = json.loads((tmp_path / "out" / "_SUCCESS").read_text())
    assert summary["error_rows"] == 4
    # The duplicates count against the budget: with a 10% budget the same job exits 3.
    assert main(["submit", spec, "--set", "runtime.max_error_fraction=0.1",
                 "--set", f"output.path={tmp_path / 'strict'}"]) == 3
