"""The scale-out path's checks that need no cluster: which paths a multi-node cluster refuses, the
benchmark stub engine's identity, and a resume that reuses the first run's duplicate-id verdict.

In-process submits on the local executor with `runtime.benchmark_stub_engine` (no model runs), so the
file takes seconds; the cluster itself is exercised in test_ray_cluster.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from deepinfer.pipeline.cli.main import main
from deepinfer.pipeline.executors.ray_data import RaySession, engine_count, storage_problems
from deepinfer.pipeline.stages.generate import STUB_TEXT

from tests.support.cli_harness import snapshot, write_jsonl


def session(nodes: int, client: bool = False) -> RaySession:
    return RaySession(owned=False, num_gpus=0, num_cpus=4.0 * nodes, node_cpus=(4.0,) * nodes, client=client)


def test_local_paths_are_refused_on_several_nodes_unless_declared_shared() -> None:
    assert storage_problems("/data/in", "/data/out", False, session(1)) == []
    problems = storage_problems("/data/in/*.jsonl", "file:///data/out", False, session(3))
    assert [p.split(":")[0] for p in problems] == ["input.path", "output.path"]
    assert all("3 nodes" in p and "runtime.shared_filesystem: true" in p for p in problems), problems
    assert storage_problems("/data/in", "/data/out", True, session(3)) == []
    assert storage_problems("s3://b/in", "s3://b/out", False, session(3)) == []
    # through Ray Client the driver is on no node of the cluster, even a one-node one
    (problem,) = storage_problems("s3://b/in", "/data/out", False, session(1, client=True))
    assert problem.startswith("output.path") and "Ray Client" in problem


def test_cpu_engines_default_to_one_per_node() -> None:
    assert engine_count(None, session(1), use_gpu=False) == 1
    assert engine_count(None, session(3), use_gpu=False) == 3
    assert engine_count(2, session(3), use_gpu=False) == 2


def _job(tmp: Path, model: str, rows: list[dict]) -> Path:
    data = write_jsonl(tmp / "in.jsonl", rows)
    spec = tmp / "job.yaml"
    spec.write_text(json.dumps({  # JSON is YAML
        "name": "checks",
        "model": {"path": model},
        "input": {"path": str(data), "format": "jsonl", "id_column": "rid"},
        "prompt": {"mode": "raw", "template": "Review: {{ review }}"},
        "sampling": {"max_tokens": 2, "seed": 4},
        "output": {"path": str(tmp / "unused"), "format": "parquet"},
        "runtime": {"executor": "local", "rows_per_part": 5, "batch_size": 4, "max_error_fraction": 0.5,
                    "benchmark_stub_engine": True},
    }))
    return spec


@pytest.fixture()
def rows() -> list[dict]:
    out = [{"rid": f"r{i:03d}", "review": f"item {i} is " + "fine " * (1 + i % 4)} for i in range(30)]
    for i in (7, 13, 22):  # repeats of earlier ids: quarantined as DUPLICATE_ID
        out[i]["rid"] = out[i - 5]["rid"]
    return out


def test_a_resume_reuses_the_recorded_duplicate_verdict(tmp_path, tiny_checkpoint, rows, monkeypatch):
    spec = _job(tmp_path, str(tiny_checkpoint("llama")), rows)
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert main(["submit", str(spec), "--set", f"output.path={ref}"]) == 0
    record = json.loads((ref / "_job.json").read_text())
    assert record["duplicates"] == {"0": [7, 13, 22]}

    assert main(["submit", str(spec), "--set", f"output.path={out}"]) == 0
    markers = sorted((out / "_commits").iterdir())
    for marker in markers[len(markers) // 2:]:  # a run killed halfway, as the chaos tests leave it
        for obj in json.loads(marker.read_text())["objects"]:
            (out / obj["path"]).unlink()
        marker.unlink()
    (out / "_SUCCESS").unlink()

    def no_second_pass(*args, **kwargs):
        raise AssertionError("a resume read every id again")

    monkeypatch.setattr("deepinfer.pipeline.stages.dedupe.find_duplicates", no_second_pass)
    assert main(["submit", str(spec), "--set", f"output.path={out}"]) == 0
    assert snapshot(str(out)) == snapshot(str(ref))  # byte for byte, duplicates quarantined alike


def test_the_stub_engine_is_labelled_and_never_taken_for_a_real_run(tmp_path, tiny_checkpoint, rows, capsys):
    spec = _job(tmp_path, str(tiny_checkpoint("llama")), rows[:5])
    out = tmp_path / "out"
    assert main(["submit", str(spec), "--set", f"output.path={out}"]) == 0
    assert "PIPELINE BENCHMARK MODE" in capsys.readouterr().err
    import pyarrow.parquet as pq

    texts = pq.read_table(next((out / "parts").iterdir())).column("text").to_pylist()
    seeds = pq.read_table(next((out / "parts").iterdir())).column("seed").to_pylist()
    assert texts == [STUB_TEXT.format(seed=s) for s in seeds]
    # the same job with the real engine is another job: exit 4, naming the setting
    code = main(["submit", str(spec), "--set", f"output.path={out}", "--set",
                 "runtime.benchmark_stub_engine=false"])
    assert code == 4 and "runtime" in capsys.readouterr().err
