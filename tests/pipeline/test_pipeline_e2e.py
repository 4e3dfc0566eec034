"""`deepinfer-job submit` end to end on a tiny model: JSONL and Parquet, chat and raw prompts, typed
output_schema columns, both executors byte-identical, quarantined rows, error budget, resume and exit codes.

One Ray instance is shared by the module; the runner attaches to it (and leaves it running).
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deepinfer.engine.sample.rng import derive_seed
from deepinfer.pipeline.cli.main import main
from deepinfer.pipeline.summary import validate_summary
from jsonschema import Draft202012Validator

from tests.support.pipeline_helpers import (
    output_digest,
    read_parts,
    review_rows,
    write_jsonl,
    write_spec,
)

LABEL_SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["good", "bad"]},
        "stars": {"type": "integer", "minimum": 1, "maximum": 5},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["label", "stars", "ok", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def ray_session(shared_ray):
    """This process attached to the session's local Ray (2 CPUs, tests/support/ray_local.py)."""
    shared_ray.start()
    return pytest.importorskip("ray")


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def jsonl_input(tmp_path_factory) -> Path:
    """Three JSONL files in a directory tree: 11 good rows, one null `text`, one without `text`, one
    malformed line."""
    root = tmp_path_factory.mktemp("jsonl_in")
    write_jsonl(root / "a.jsonl", review_rows(5), blank_lines=True)
    bad = review_rows(4, start=5)
    bad[1]["text"] = None
    del bad[2]["text"]
    write_jsonl(root / "b.jsonl", bad)
    write_jsonl(root / "sub" / "c.jsonl", review_rows(4, start=9))
    with (root / "sub" / "c.jsonl").open("a") as f:
        f.write('{"rid": "r013", "text": \n')  # undecodable: quarantined as BAD_ROW at stage read
    return root


def labeling_spec(model_dir: str, input_path: Path, output: Path, **runtime) -> dict:
    return {
        "name": "e2e-labels",
        "model": {"path": model_dir},
        "input": {"path": str(input_path), "format": "jsonl", "id_column": "rid"},
        "prompt": {"mode": "chat", "system": "Label the review.", "template": "{{ text }}"},
        "sampling": {"temperature": 0.8, "max_tokens": 48, "seed": 7},
        "output_schema": LABEL_SCHEMA,
        "output": {"path": str(output), "format": "parquet", "keep_columns": ["topic"]},
        "runtime": {"rows_per_part": 4, "batch_size": 3, "sort_window": 5, "max_error_fraction": 0.5,
                    **runtime},
    }


def test_jsonl_chat_schema_job_is_byte_identical_on_ray_with_two_engines_and_local(
        tmp_path, ray_session, model_dir, jsonl_input) -> None:
    outs = {}
    for executor, engines in (("local", None), ("ray", 2)):
        out = tmp_path / executor
        spec = write_spec(tmp_path / f"{executor}.yaml", labeling_spec(model_dir, jsonl_input, out,
                                                                       executor=executor, engines=engines))
        summary_path = tmp_path / f"{executor}-summary.json"
        assert main(["submit", spec, "--summary-json", str(summary_path)]) == 0
        outs[executor] = out
        summary = json.loads(summary_path.read_text())
        validate_summary(summary)
        assert summary["rows"]["total"] == 14 and summary["parts"]["total"] == 5
        assert summary["rows"]["ok"] + summary["rows"]["errored"] == 14
        assert json.loads((out / "_SUCCESS").read_text())["summary"]["status"] == "succeeded"
    assert output_digest(outs["local"]) == output_digest(outs["ray"])

    rows, errors = read_parts(outs["ray"]), read_parts(outs["ray"], "errors")
    quarantined = {r["id"]: (r["stage"], r["code"]) for r in errors.to_pylist()}
    assert quarantined["r006"] == ("prompt", "NULL_VALUE")
    assert quarantined["r007"] == ("prompt", "MISSING_COLUMN")
    assert quarantined["sub/c.jsonl:4"] == ("read", "BAD_ROW")
    assert rows.num_rows + errors.num_rows == 14
    expected_ids = {f"r{i:03d}" for i in range(13)} | {"sub/c.jsonl:4"}
    assert set(rows.column("rid").to_pylist()) | set(quarantined) == expected_ids
    types = {f.name: f.type for f in rows.schema}
    assert types["label"] == pa.string() and types["stars"] == pa.int64() and types["ok"] == pa.bool_()
    assert types["tags"] == pa.list_(pa.string()) and types["json"] == pa.string()
    assert rows.column_names[:6] == ["rid", "text", "finish_reason", "prompt_tokens", "output_tokens", "seed"]
    validator = Draft202012Validator(LABEL_SCHEMA)
    for r in rows.to_pylist():
        parsed = json.loads(r["json"])
        assert not list(validator.iter_errors(parsed))
        typed = (r["label"], r["stars"], r["ok"], r["tags"])
        assert typed == tuple(parsed[k] for k in LABEL_SCHEMA["properties"])
        assert r["seed"] == derive_seed(7, r["rid"])
        assert r["topic"] == review_rows(13)[int(r["rid"][1:])]["topic"]
        assert r["finish_reason"] == "stop"


@pytest.fixture(scope="module")
def parquet_input(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pq_in")
    for name, start, n in (("p1.parquet", 0, 5), ("p2.parquet", 5, 3)):
        pq.write_table(pa.table({
            "question": [f"Question {i}: what is {i} plus {i}?" for i in range(start, start + n)],
            "level": pa.array(range(start, start + n), pa.int32()),
            "asked": pa.array([dt.datetime(2024, 1, 1 + i) for i in range(start, start + n)],
                              pa.timestamp("ms")),
        }), root / name, row_group_size=2)
    return root


def test_parquet_raw_job_derives_ids_and_keeps_typed_columns(tmp_path, model_dir, parquet_input) -> None:
    out = tmp_path / "out"
    doc = {
        "model": {"path": model_dir},
        "input": {"path": str(parquet_input / "*.parquet"), "format": "parquet"},
        "prompt": {"mode": "raw", "template": "Q: {{ question }}\nA:"},
        "sampling": {"temperature": 0, "max_tokens": 6},
        "output": {"path": str(out), "keep_columns": ["level", "asked"]},
        "runtime": {"executor": "local", "rows_per_part": 3, "batch_size": 2},
    }
    assert main(["submit", write_spec(tmp_path / "job.yaml", doc)]) == 0
    rows = read_parts(out)
    assert rows.column("id").to_pylist() == [f"p1.parquet:{i}" for i in range(5)] + [
        f"p2.parquet:{i}" for i in range(3)]
    assert rows.schema.field("level").type == pa.int32()
    assert rows.schema.field("asked").type == pa.timestamp("ms")
    assert rows.column("level").to_pylist() == list(range(8))
    assert all(n <= 6 for n in rows.column("output_tokens").to_pylist())
    assert "json" not in rows.column_names
    assert sorted(p.name[:16] for p in (out / "parts").iterdir()) == [
        "00000-0000000000", "00000-0000000003", "00001-0000000000"]


def _small_job(tmp_path: Path, model_dir: str, input_path: Path, **changes) -> dict:
    doc = {
        "model": {"path": model_dir},
        "input": {"path": str(input_path), "format": "jsonl", "id_column": "rid"},
        "prompt": {"mode": "raw", "template": "{{ rid }}: {{ topic }}"},
        "sampling": {"max_tokens": 5, "seed": 1},
        "output": {"path": str(tmp_path / "out"), "format": "jsonl"},
        "runtime": {"executor": "local", "rows_per_part": 2},
    }
    for key, value in changes.items():
        section, _, field = key.partition("__")
        doc[section][field] = value
    return doc


def test_resume_skips_committed_parts_and_gives_identical_bytes(tmp_path, model_dir, capsys) -> None:
    write_jsonl(tmp_path / "in.jsonl", review_rows(7))
    spec = write_spec(tmp_path / "job.yaml", _small_job(tmp_path, model_dir, tmp_path / "in.jsonl"))
    out = tmp_path / "out"
    assert main(["submit", spec]) == 0
    full = output_digest(out)
    assert len([k for k in full if k.startswith("parts/")]) == 4

    # A run killed after two commits: drop the last two parts' markers and data, and _SUCCESS.
    for marker in sorted((out / "_commits").glob("*.json"))[2:]:
        for obj in json.loads(marker.read_text())["objects"]:
            (out / obj["path"]).unlink()
        marker.unlink()
    (out / "_SUCCESS").unlink()
    summary_path = tmp_path / "summary.json"
    assert main(["submit", spec, "--summary-json", str(summary_path)]) == 0
    assert output_digest(out) == full
    summary = json.loads(summary_path.read_text())
    assert summary["parts"] == {"total": 4, "committed_this_run": 2, "resumed": 2}
    assert summary["rows"]["resumed"] == 4 and summary["rows"]["this_run"] == 3

    capsys.readouterr()
    assert main(["submit", spec, "--summary-json", str(summary_path)]) == 0  # complete: nothing to do
    assert "nothing to do" in capsys.readouterr().err
    # This call's own figures (it committed and generated nothing), the job's totals (schema-valid).
    noop = json.loads(summary_path.read_text())
    validate_summary(noop)
    assert noop["parts"] == {"total": 4, "committed_this_run": 0, "resumed": 4}
    assert noop["rows"]["this_run"] == 0 and noop["rows"]["resumed"] == 7 == noop["rows"]["total"]
    assert noop["tokens"]["output"] == 0 and noop["engines"] == [] and noop["wall_seconds"] < 30
    assert main(["status", str(out), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["state"] == "complete" and status["committed_parts"] == 4

    assert main(["submit", spec, "--set", "sampling.seed=2"]) == 4  # another job's output
    assert "sampling" in capsys.readouterr().err
    assert main(["submit", spec, "--set", "sampling.seed=2", "--restart"]) == 0
    assert output_digest(out) != full


def test_error_budget_exceeded_exits_3_and_quarantines_rows(tmp_path, model_dir, capsys) -> None:
    write_jsonl(tmp_path / "in.jsonl", review_rows(5))
    doc = _small_job(tmp_path, model_dir, tmp_path / "in.jsonl", prompt__template="{{ missing_column }}")
    doc["runtime"].update(sort_window=2, batch_size=2)
    summary_path = tmp_path / "summary.json"
    assert main(["submit", write_spec(tmp_path / "job.yaml", doc), "--summary-json", str(summary_path)]) == 3
    assert "error budget exceeded" in capsys.readouterr().err
    out = tmp_path / "out"
    assert not (out / "_SUCCESS").exists()
    errors = read_parts(out, "errors")
    assert set(errors.column("code").to_pylist()) == {"MISSING_COLUMN"}
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "error_budget_exceeded" and summary["exit_code"] == 3
    # The verdict stops the run early: the first part's errors already exceed the budget.
    assert errors.num_rows == summary["rows"]["errored"] == 2


def test_too_long_prompts_are_quarantined_at_tokenize(tmp_path, model_dir) -> None:
    rows = review_rows(4)
    rows[2]["topic"] = "very long " * 40
    write_jsonl(tmp_path / "in.jsonl", rows)
    doc = _small_job(tmp_path, model_dir, tmp_path / "in.jsonl", model__max_model_len=64,
                     runtime__max_error_fraction=0.5)
    assert main(["submit", write_spec(tmp_path / "job.yaml", doc)]) == 0
    errors = read_parts(tmp_path / "out", "errors").to_pylist()
    assert [(e["id"], e["stage"], e["code"]) for e in errors] == [("r002", "tokenize", "PROMPT_TOO_LONG")]
    assert read_parts(tmp_path / "out").column("rid").to_pylist() == ["r000", "r001", "r003"]


def test_submit_usage_errors_exit_2_before_any_work(tmp_path, model_dir, capsys) -> None:
    write_jsonl(tmp_path / "in.jsonl", review_rows(2))
    spec = write_spec(tmp_path / "job.yaml", _small_job(tmp_path, model_dir, tmp_path / "in.jsonl"))
    assert main(["submit", spec, "--set", f"input.path={tmp_path / 'nothing-here'}"]) == 2
    assert "input.path" in capsys.readouterr().err
    assert main(["submit", spec, "--set", f"model.path={tmp_path}"]) == 2
    assert "model.path" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    shutil.rmtree(tmp_path / "out", ignore_errors=True)


def test_engine_rejecting_one_row_quarantines_only_that_row(model_dir) -> None:
    from deepinfer.pipeline.stages import columns as C
    from deepinfer.pipeline.stages.generate import EngineStage

    stage = EngineStage(model_dir, {"device": "cpu"}, {"temperature": 0.0, "max_tokens": 3}, 5, None)
    n = 3
    batch = C.table({
        "__part": ["00000-0000000000"] * n, "__file": [0] * n, "__row": list(range(n)),
        "__source": [f"f:{i}" for i in range(n)], "__row_id": ["a", "b", "c"], "__keep": ["{}"] * n,
        "__user": ["x"] * n, "__ids": [[5, 6, 7], [5, 10**7], [8, 9]], "__plen": [3, 2, 2],
    }, C.TOKENIZE_SCHEMA)
    out = stage(batch).to_pylist()
    assert [r["__err_code"] for r in out] == [None, "GENERATION_ERROR", None]
    assert out[1]["__err_stage"] == "generate" and "vocabulary" in out[1]["__err_msg"]
    assert [r["__ntok"] for r in out] == [3, None, 3]
    alone = stage(batch.slice(2, 1)).to_pylist()[0]
    assert alone["__text"] == out[2]["__text"] and alone["__seed"] == out[2]["__seed"]


def test_tokenize_stage_sorts_each_window_by_prompt_length(model_dir) -> None:
    from deepinfer.pipeline.stages import columns as C
    from deepinfer.pipeline.stages.prompt import TokenizeStage

    texts = ["a much longer prompt than the others here", "short", "medium sized prompt", "tiny"]
    n = len(texts)
    batch = C.table({"__part": ["p"] * n, "__file": [0] * n, "__row": list(range(n)),
                     "__source": [f"f:{i}" for i in range(n)], "__row_id": list("abcd"),
                     "__keep": ["{}"] * n, "__user": texts}, C.PROMPT_SCHEMA)
    out = TokenizeStage(model_dir, "raw", 512, "2025-01-01")(batch)
    lengths = out.column("__plen").to_pylist()
    assert lengths == sorted(lengths) and min(lengths) > 0
    assert out.column("__row_id").to_pylist()[-1] == "a"
    assert [len(ids) for ids in out.column("__ids").to_pylist()] == lengths


def test_killed_submit_resumes_to_the_same_bytes(tmp_path, model_dir) -> None:
    import os
    import subprocess
    import sys

    write_jsonl(tmp_path / "in.jsonl", review_rows(6))
    doc = _small_job(tmp_path, model_dir, tmp_path / "in.jsonl")
    doc["runtime"].update(sort_window=2, batch_size=2)
    spec = write_spec(tmp_path / "job.yaml", doc)
    reference = tmp_path / "reference"
    assert main(["submit", spec, "--set", f"output.path={reference}"]) == 0

    # SIGKILL after the second part's data is written but before its commit marker (leaves an orphan).
    env = {**os.environ, "DEEPINFER_TEST_KILL_AT": "after_part_data_written:2",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-m", "tests.support.killable_cli", "submit", spec], env=env,
                          capture_output=True, text=True, timeout=300, start_new_session=True)
    assert proc.returncode == -9, proc.stderr[-2000:]
    out = tmp_path / "out"
    assert len(list((out / "_commits").glob("*.json"))) == 1 and not (out / "_SUCCESS").exists()
    assert main(["submit", spec]) == 0
    assert output_digest(out) == output_digest(reference)


def test_part_collector_completes_parts_once_despite_duplicate_rows() -> None:
    from deepinfer.pipeline.parts import PartTask
    from deepinfer.pipeline.runner import PartCollector
    from deepinfer.pipeline.stages import columns as C

    def rows(part: str, idx: list[int]) -> pa.Table:
        n = len(idx)
        return C.table({"__part": [part] * n, "__file": [0] * n, "__row": idx, "__source": ["s"] * n,
                        "__row_id": [str(i) for i in idx], "__keep": ["{}"] * n}, C.ENGINE_SCHEMA)

    collector = PartCollector([PartTask("A", 0, "f", "f", 0, 3), PartTask("B", 0, "f", "f", 5, 2)])
    assert collector.add(pa.concat_tables([rows("A", [0, 1]), rows("B", [5])])) == []
    assert collector.add(rows("A", [1])) == []  # a retried row: A still lacks row 2
    done = collector.add(pa.concat_tables([rows("A", [2]), rows("B", [6])]))
    got = [(p.part_id, t.column("__row").to_pylist()) for p, t in done]
    assert got == [("A", [0, 1, 2]), ("B", [5, 6])]
    assert collector.add(rows("A", [0])) == [] and collector.pending() == []
