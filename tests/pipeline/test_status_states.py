"""`status` reads what happened to a job: running (live run, counts growing part by part), interrupted
(killed), failed (exit code and reason, from `_FAILED`), complete; and each run's summary counts only the
parts it committed itself, also when two submits race on one output.

Local executor; a tiny random Llama for the run watched live, the stub engine (one token per row) for
the rest, so that the whole file takes seconds of compute.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from deepinfer.pipeline.cli.main import main
from deepinfer.pipeline.errors import ExitCode, RetryableStorageError, SpecError
from deepinfer.pipeline.output.job_store import failure_reason
from deepinfer.pipeline.output.status import job_status, render_status

from tests.support.cli_harness import kill_group, start_submit, write_jsonl

PARTS = 8
ROWS_PER_PART = 10


def _spec(tmp: Path, model: str, data: Path, out: Path, **runtime) -> Path:
    spec = tmp / "job.yaml"
    spec.write_text(json.dumps({  # JSON is YAML
        "name": "states",
        "model": {"path": model},
        "input": {"path": str(data), "format": "jsonl", "id_column": "rid"},
        "prompt": {"mode": "raw", "template": "Review: {{ review }}"},
        "sampling": {"temperature": 0.8, "max_tokens": 8, "seed": 5},
        "output": {"path": str(out), "format": "parquet"},
        "runtime": {"executor": "local", "rows_per_part": ROWS_PER_PART, "batch_size": 4, **runtime},
    }))
    return spec


def _rows(n: int, missing_every: int = 0) -> list[dict]:
    rows = [{"rid": f"r{i:04d}", "review": f"item {i} is " + "fine " * (1 + i % 5)} for i in range(n)]
    for i in range(0, n, missing_every) if missing_every else []:
        del rows[i]["review"]  # the template then fails: the row is quarantined (MISSING_COLUMN)
    return rows


@pytest.fixture()
def model(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


def test_running_then_interrupted_then_complete(tmp_path, model) -> None:
    data = write_jsonl(tmp_path / "in.jsonl", _rows(PARTS * ROWS_PER_PART))
    out = tmp_path / "out"
    spec = _spec(tmp_path, model, data, out)
    proc = start_submit(spec, str(out))
    seen: list[int] = []
    while proc.poll() is None and len(set(seen)) < 3:
        st = job_status(str(out))
        if st["state"] != "empty":
            assert st["state"] == "running" and st["live_runs"] == 1, st
            seen.append(st["committed_parts"])
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before status saw it commit part by part"
    assert sorted(set(seen))[-1] < PARTS and sorted(seen) == seen, seen  # counts grow while it runs
    kill_group(proc)

    st = job_status(str(out))
    assert (st["state"], st["live_runs"], st["failure"]) == ("interrupted", 0, None), st
    assert 0 < st["committed_parts"] < PARTS
    assert st["committed_rows"] == st["committed_parts"] * ROWS_PER_PART
    assert "interrupted" in render_status(st)

    assert main(["submit", str(spec)]) == 0
    st = job_status(str(out))
    assert (st["state"], st["committed_parts"], st["committed_rows"]) == ("complete", PARTS, PARTS * 10)


def test_error_budget_exit_is_reported_failed_until_a_rerun_succeeds(tmp_path, model, monkeypatch,
                                                                     capsys) -> None:
    data = write_jsonl(tmp_path / "in.jsonl", _rows(40, missing_every=4))
    out = tmp_path / "out"
    spec = _spec(tmp_path, model, data, out, max_error_fraction=0.1, benchmark_stub_engine=True)
    assert main(["submit", str(spec)]) == ExitCode.BUDGET
    st = job_status(str(out))
    assert st["state"] == "failed" and st["live_runs"] == 0, st
    assert (st["failure"]["exit_code"], st["failure"]["reason"]) == (3, "error_budget")
    assert "error budget exceeded" in st["failure"]["message"]
    capsys.readouterr()
    assert main(["status", str(out)]) == 0
    assert "state:    failed (exit 3, error_budget)" in capsys.readouterr().out

    # A rerun that fits its budget removes the record: a finished output holds no _FAILED.
    assert main(["submit", str(spec), "--set", "runtime.max_error_fraction=0.5"]) == 0
    st = job_status(str(out))
    assert (st["state"], st["failure"]) == ("complete", None)
    assert not (out / "_FAILED").exists()


def test_failure_reasons_name_the_cause() -> None:
    storage = RetryableStorageError("s3 throttled")
    wrapped = RuntimeError("task failed")
    wrapped.__cause__ = storage
    assert failure_reason(ExitCode.RETRY, wrapped) == "storage"
    assert failure_reason(ExitCode.RETRY, TimeoutError("lost worker")) == "transient"
    assert failure_reason(ExitCode.USAGE, SpecError(["model: refused"])) == "spec"
    assert failure_reason(ExitCode.BUDGET) == "error_budget"
    assert failure_reason(ExitCode.BUG, KeyError("x")) == "bug"


def test_racing_submits_each_count_only_their_own_commits(tmp_path, model) -> None:
    data = write_jsonl(tmp_path / "in.jsonl", _rows(400))
    out = tmp_path / "out"
    spec = _spec(tmp_path, model, data, out, benchmark_stub_engine=True)
    procs = [start_submit(spec, str(out), "--summary-json", str(tmp_path / f"s{i}.json"))
             for i in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
    summaries = [json.loads((tmp_path / f"s{i}.json").read_text()) for i in range(2)]
    total = 400 // ROWS_PER_PART
    assert sum(s["parts"]["committed_this_run"] for s in summaries) == total
    for s in summaries:
        mine, resumed, raced = (s["parts"]["committed_this_run"], s["parts"]["resumed"],
                                s["committed_by_others"]["parts"])
        assert mine + resumed + raced == total, s["parts"]
        assert s["rows"]["this_run"] == mine * ROWS_PER_PART
        assert s["rows"]["ok"] + s["rows"]["errored"] == 400
    assert job_status(str(out))["state"] == "complete"
