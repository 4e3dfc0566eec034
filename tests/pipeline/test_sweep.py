"""Sweeps and eval: a 2x3 grid over seeds and temperatures with exact_match, regex_match and contains runs
as one submit (one model build), resumes after a SIGKILL without recomputing finished points, matches an
uninterrupted run and a point run alone byte for byte; scores and metrics are recomputed here independently.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from deepinfer.pipeline.cli.main import main
from deepinfer.pipeline.errors import ExitCode

from tests.support.pipeline_helpers import output_digest, read_parts, write_jsonl, write_spec

ROOT = Path(__file__).resolve().parents[2]
SEEDS, TEMPS = [1, 2], [0.5, 0.7, 1.0]
POINT_IDS = [f"sampling.seed={s},sampling.temperature={t}" for s in SEEDS for t in TEMPS]
PATTERN = r"(\S)"
QUESTIONS = [  # references are single letters so that regex_match and contains score both ways
    {"qid": i, "question": f"Name a letter, number {i}.", "answer": a, "category": c}
    for i, (a, c) in enumerate([("e", "vowel"), ("A", "vowel"), ("t", "consonant"), ("o", "vowel"),
                                ("s", "consonant"), ("x", "consonant")])
]


def _spec(model_dir: str, data: Path, out: Path, sweep: bool = True, **sampling) -> dict:
    doc = {
        "name": "sweep-test",
        "model": {"path": model_dir},
        "input": {"path": str(data), "format": "jsonl", "id_column": "qid"},
        "prompt": {"mode": "raw", "template": "Q: {{ question }}\nA:"},
        "sampling": {"temperature": 0.9, "max_tokens": 4, "seed": 0, **sampling},
        "eval": {"reference_column": "answer", "group_by": "category", "normalize": ["strip", "lowercase"],
                 "metrics": ["exact_match", "contains",
                             {"metric": "regex_match", "name": "first_char", "pattern": PATTERN}]},
        "output": {"path": str(out), "format": "jsonl"},
        "runtime": {"executor": "local", "rows_per_part": 3, "batch_size": 2},
    }
    if sweep:
        doc["sweep"] = {"grid": {"sampling.seed": SEEDS, "sampling.temperature": TEMPS}}
    return doc


def _expected_scores(text: str, answer: str) -> dict[str, float]:
    norm = lambda s: s.strip().lower()  # noqa: E731 - the spec's normalize: [strip, lowercase]
    found = re.search(PATTERN, text)
    return {"score_exact_match": float(norm(text) == norm(answer)),
            "score_contains": float(norm(answer) in norm(text)),
            "score_first_char": float(found is not None and norm(found.group(1)) == norm(answer))}


def _summary(values: list[float]) -> tuple[int, float, float | None]:
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
    return n, mean, (sd / math.sqrt(n) if sd is not None else None)


def _check_point_metrics(point: Path) -> dict[str, tuple]:
    rows = read_parts(point).to_pylist()
    assert len(rows) == len(QUESTIONS)
    by_id = {str(q["qid"]): q for q in QUESTIONS}  # JSONL ids are written as text
    for r in rows:  # scores sit in the parts, next to the reference and group columns kept for them
        assert r["answer"] == by_id[r["qid"]]["answer"] and r["category"] == by_id[r["qid"]]["category"]
        for col, want in _expected_scores(r["text"], r["answer"]).items():
            assert r[col] == want, (point.name, r["qid"], col)
    metrics = json.loads((point / "metrics.json").read_text())
    out = {}
    for name in ("exact_match", "contains", "first_char"):
        values = [r[f"score_{name}"] for r in rows]
        n, mean, se = _summary(values)
        got = metrics["metrics"][name]
        assert got["n"] == n and got["mean"] == pytest.approx(mean)
        assert got["stderr"] == pytest.approx(se)
        for group in ("vowel", "consonant"):
            gv = [r[f"score_{name}"] for r in rows if r["category"] == group]
            assert got["groups"][group]["mean"] == pytest.approx(sum(gv) / len(gv))
            assert got["groups"][group]["n"] == len(gv)
        out[name] = (n, mean, se)
    return out


def test_grid_sweep_one_submit_resume_after_sigkill_and_one_point_alone(tmp_path, model_dir, monkeypatch,
                                                                         capsys) -> None:
    from deepinfer.pipeline.stages import generate

    data = tmp_path / "q.jsonl"
    write_jsonl(data, QUESTIONS)
    builds = []
    real_build = generate._build_llm
    monkeypatch.setattr(generate, "_build_llm", lambda *a: builds.append(a) or real_build(*a))

    # 1. one uninterrupted submit runs all six points with one model build
    full = tmp_path / "full"
    spec_full = write_spec(tmp_path / "full.yaml", _spec(model_dir, data, full))
    assert main(["submit", spec_full]) == 0
    assert len(builds) == 1
    assert sorted(p.name for p in (full / "points").iterdir()) == sorted(POINT_IDS)
    expected = {}
    for pid in POINT_IDS:
        expected[pid] = _check_point_metrics(full / "points" / pid)
    table = pq.read_table(full / "metrics.parquet").to_pylist()
    assert len(table) == len(POINT_IDS) * 3
    for row in table:
        n, mean, se = expected[row["point"]][row["metric"]]
        assert (row["n"], row["mean"], row["stderr"]) == (n, pytest.approx(mean), pytest.approx(se))
        assert row["point"] == f"sampling.seed={row['sampling.seed']},sampling.temperature=" \
                               f"{row['sampling.temperature']}"
    capsys.readouterr()
    assert main(["status", str(full), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert [p["id"] for p in status["points"]] == POINT_IDS
    assert status["state"] == "complete" and {p["state"] for p in status["points"]} == {"complete"}
    assert main(["report", str(full)]) == 0
    report = capsys.readouterr().out
    assert all(pid in report for pid in POINT_IDS) and "first_char" in report

    # 2. SIGKILLed right after its 5th commit (points 1-2 done, point 3 half), then resumed
    killed = tmp_path / "killed"
    spec_killed = write_spec(tmp_path / "killed.yaml", _spec(model_dir, data, killed))
    env = {**os.environ, "DEEPINFER_TEST_KILL_AT": "after_part_committed:5", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.support.killable_cli", "submit", spec_killed],
                          cwd=ROOT, env=env, start_new_session=True, capture_output=True, timeout=300)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    points = [killed / "points" / pid for pid in POINT_IDS]
    assert [(p / "_SUCCESS").exists() for p in points[:3]] == [True, True, False]
    assert len(list((points[2] / "_commits").glob("*.json"))) == 1
    before = {str(f): f.stat().st_mtime_ns for p in points[:3] for f in p.rglob("*") if f.is_file()
              and "_runs" not in f.parts}
    capsys.readouterr()
    assert main(["submit", spec_killed]) == 0
    err = capsys.readouterr().err
    assert err.count("already holds this job, complete; nothing to do") == 2
    assert "1 parts already committed; running 1 parts" in err
    for path, mtime in before.items():  # nothing finished was rewritten
        if "_FAILED" not in path:
            assert os.stat(path).st_mtime_ns == mtime, path
    for pid in POINT_IDS:
        assert output_digest(killed / "points" / pid) == output_digest(full / "points" / pid), pid
        assert (killed / "points" / pid / "metrics.json").read_bytes() == \
               (full / "points" / pid / "metrics.json").read_bytes()
    assert (killed / "metrics.parquet").read_bytes() == (full / "metrics.parquet").read_bytes()

    # 3. one point run alone (the same settings, no sweep) gives byte-identical parts
    alone = tmp_path / "alone"
    spec_alone = write_spec(tmp_path / "alone.yaml",
                            _spec(model_dir, data, alone, sweep=False, seed=2, temperature=0.7))
    assert main(["submit", spec_alone]) == 0
    assert output_digest(alone) == output_digest(full / "points" / "sampling.seed=2,sampling.temperature=0.7")


def test_sweep_and_eval_spec_errors_name_the_field(tmp_path, model_dir, capsys) -> None:
    data = tmp_path / "q.jsonl"
    write_jsonl(data, QUESTIONS)
    cases = [
        ({"sweep": {"zip": {"sampling.seed": [1, 2], "sampling.temperature": [0.1]}}}, "sweep.zip"),
        ({"sweep": {"grid": {"output.path": ["/tmp/x"]}}}, "sweep"),
        ({"sweep": {"grid": {"sampling.top_k": [0]}}}, "sweep point sampling.top_k=0: sampling.top_k"),
        ({"eval": {"reference_column": "answer", "metrics": [{"metric": "regex_match"}]}}, "eval.metrics[0]"),
        ({"eval": {"reference_column": "answer", "metrics": ["exact_match", "exact_match"]}}, "eval.metrics"),
        ({"eval": {"reference_column": "answer", "metrics": ["bleu"]}}, "eval.metrics"),
    ]
    for i, (extra, field) in enumerate(cases):
        doc = {**_spec(model_dir, data, tmp_path / "o", sweep=False), **extra}
        spec = write_spec(tmp_path / f"bad{i}.yaml", doc)
        assert main(["validate", spec]) == ExitCode.USAGE, extra
        assert field in capsys.readouterr().err, extra


def test_eval_job_without_sweep_writes_metrics_and_report(tmp_path, model_dir, capsys) -> None:
    data = tmp_path / "q.jsonl"
    write_jsonl(data, QUESTIONS)
    out = tmp_path / "out"
    assert main(["submit", write_spec(tmp_path / "s.yaml", _spec(model_dir, data, out, sweep=False))]) == 0
    _check_point_metrics(out)
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    text = capsys.readouterr().out
    assert "6 rows scored, 0 quarantined" in text and "consonant" in text
    assert main(["report", str(tmp_path)]) == ExitCode.USAGE
    assert main(["verify", str(out), "--sample", "6"]) == 0  # score columns are recomputed too
    # the eval section is fingerprinted: other metrics over the same output are another job
    doc = _spec(model_dir, data, out, sweep=False)
    doc["eval"]["normalize"] = ["strip"]
    assert main(["submit", write_spec(tmp_path / "s2.yaml", doc)]) == ExitCode.OTHER_JOB


def test_shipped_eval_sweep_is_valid_and_covers_the_sample_questions(capsys) -> None:
    assert main(["validate", str(ROOT / "jobs" / "eval_sweep.yaml")]) == 0
    assert "a sweep of 6 points" in capsys.readouterr().out
