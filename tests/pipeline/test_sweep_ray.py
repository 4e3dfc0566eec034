"""A sweep on the Ray executor: its points share one Ray Data pipeline and one engine pool, so each model
is built once per sweep (the run summaries of every point name the same single engine actor, where a
run per point would name one per point); every point is still its own exactly-once job, byte-identical
to the point run alone, and a sweep with one point removed reruns only that point.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from deepinfer.pipeline.cli.main import main

from tests.support.pipeline_helpers import output_digest, write_jsonl, write_spec

SEEDS = [1, 2, 3]
POINT_IDS = [f"sampling.seed={s}" for s in SEEDS]
ROWS = [{"qid": i, "question": f"Name a letter, number {i}."} for i in range(5)]


@pytest.fixture(scope="module")
def ray_session(shared_ray):
    """This process attached to the session's local Ray (2 CPUs, tests/support/ray_local.py)."""
    shared_ray.start()
    return pytest.importorskip("ray")


def _spec(model_dir: str, data: Path, out: Path, executor: str, seed: int | None = None) -> dict:
    doc = {
        "name": "sweep-ray",
        "model": {"path": model_dir},
        "input": {"path": str(data), "format": "jsonl", "id_column": "qid"},
        "prompt": {"mode": "raw", "template": "Q: {{ question }}\nA:"},
        "sampling": {"temperature": 0.9, "max_tokens": 4, "seed": 0 if seed is None else seed},
        "output": {"path": str(out), "format": "jsonl"},
        "runtime": {"executor": executor, "rows_per_part": 2, "batch_size": 2, "engines": 1,
                    "engine_cpus": 0.5},
    }
    if seed is None:
        doc["sweep"] = {"grid": {"sampling.seed": SEEDS}}
    return doc


def _engines(job: Path) -> dict[str, int]:
    summary = json.loads((job / "_SUCCESS").read_text())["summary"]
    return {e["engine"]: e["rows"] for e in summary["engines"]}


def test_ray_sweep_builds_each_model_once_and_points_equal_runs_alone(tmp_path, model_dir, ray_session,
                                                                      capsys) -> None:
    data = tmp_path / "q.jsonl"
    write_jsonl(data, ROWS)
    out = tmp_path / "sweep"
    spec = write_spec(tmp_path / "sweep.yaml", _spec(model_dir, data, out, "ray"))
    assert main(["submit", spec]) == 0
    assert "3 points share one engine pool" in capsys.readouterr().err
    points = {pid: out / "points" / pid for pid in POINT_IDS}
    served = [_engines(p) for p in points.values()]
    # one engine actor (one model build) served every row of every point
    assert len({e for s in served for e in s}) == 1
    assert all(sum(s.values()) == len(ROWS) for s in served)
    sweep_engine = next(iter(served[0]))

    # each point run alone gives the same bytes (in-process: the executors' outputs are identical,
    # test_pipeline_e2e; a point per Ray run would pay a pool start each)
    for seed, pid in zip(SEEDS, POINT_IDS):
        alone = tmp_path / f"alone-{seed}"
        assert main(["submit", write_spec(tmp_path / f"alone-{seed}.yaml",
                                          _spec(model_dir, data, alone, "local", seed))]) == 0
        assert output_digest(alone) == output_digest(points[pid]), pid
    digests = {pid: output_digest(p) for pid, p in points.items()}

    # resumable point by point: a rerun recomputes only the point whose output was removed
    shutil.rmtree(points[POINT_IDS[1]])
    capsys.readouterr()
    assert main(["submit", spec]) == 0
    err = capsys.readouterr().err
    assert err.count("already holds this job, complete; nothing to do") == 2
    assert {pid: output_digest(p) for pid, p in points.items()} == digests
    rerun = _engines(points[POINT_IDS[1]])  # a new run: a new pool, whose one engine served the point
    assert len(rerun) == 1 and sweep_engine not in rerun


def test_points_group_by_engine_settings_not_by_sampling(tmp_path, model_dir) -> None:
    from deepinfer.pipeline.spec.load import JobSpec
    from deepinfer.pipeline.sweep import point_specs
    from deepinfer.pipeline.sweep_run import _engine_group_key

    doc = _spec(model_dir, tmp_path / "q.jsonl", tmp_path / "o", "ray")
    doc["sweep"]["grid"]["model.max_model_len"] = [64, 128]
    points = point_specs(JobSpec.from_document(doc))
    groups: dict[str, list[str]] = {}
    for point, spec in points:
        groups.setdefault(_engine_group_key(spec), []).append(point.id)
    # the seeds share an engine; another max_model_len is another engine (another KV-cache size)
    assert sorted(groups.values()) == sorted([f"sampling.seed={s},model.max_model_len={n}" for s in SEEDS]
                                              for n in (64, 128))
