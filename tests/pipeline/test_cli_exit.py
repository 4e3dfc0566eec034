"""`python -m deepinfer.pipeline.cli` ends with os._exit after main returns: the exit code, the printed
summary, the summary JSON and the committed output are all there and right, on success and on failure;
`main()` called in-process still returns (the caller's process goes on)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from deepinfer.pipeline.cli.main import main

from tests.support.cli_harness import cli, reader, write_jsonl


def _spec(tmp: Path, model: str) -> Path:
    data = write_jsonl(tmp / "rows.jsonl", [{"rid": f"r{i}", "text": f"row {i} good"} for i in range(6)])
    spec = tmp / "job.yaml"
    spec.write_text(json.dumps({
        "name": "fast-exit", "model": {"path": model},
        "input": {"path": str(data), "format": "jsonl", "id_column": "rid"},
        "prompt": {"mode": "raw", "template": "{{ text }}"},
        "sampling": {"temperature": 0.0, "max_tokens": 3},
        "output": {"path": str(tmp / "out"), "format": "parquet"},
        "runtime": {"executor": "local", "rows_per_part": 4, "batch_size": 4},
    }))
    return spec


def test_exit_code_summary_and_output_survive_the_fast_exit(tmp_path, model_dir):
    spec = _spec(tmp_path, model_dir)
    summary = tmp_path / "summary.json"
    code, out, err = cli("submit", str(spec), "--summary-json", str(summary))
    assert code == 0, err[-2000:]
    assert "fast-exit" in out and "exit 0" in out and "6 ok, 0 errored of 6" in out   # flushed stdout
    s = json.loads(summary.read_text())
    assert s["exit_code"] == 0 and s["rows"]["ok"] == 6
    store = reader(str(tmp_path / "out"))
    assert len(store.committed_part_ids()) == 2 and (tmp_path / "out" / "_SUCCESS").is_file()
    # A rerun finds the job complete: the fast exit left nothing half-written.
    code, out, err = cli("submit", str(spec))
    assert code == 0 and "nothing to do" in err


def test_failures_keep_their_exit_code_and_message(tmp_path, model_dir):
    spec = _spec(tmp_path, model_dir)
    code, _, err = cli("submit", str(spec), "--set", "sampling.max_tokens=-1")
    assert code == 2 and "sampling.max_tokens" in err       # the spec error, flushed before the exit
    code, _, err = cli("submit", str(tmp_path / "missing.yaml"))
    assert code == 2 and "missing.yaml" in err


def test_main_in_process_returns_its_code(tmp_path):
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 2   # returned, not exited


@pytest.mark.parametrize("args", [("status", "{out}"), ("status", "{out}", "--json"), ("validate", "{spec}")])
def test_a_read_only_command_whose_reader_stops_exits_0(tmp_path, args):
    """`deepinfer-job status ... | head`: stdout's reader is gone before the command writes; that is no
    failure (it exited 75, 'retryable failure: BrokenPipeError', before)."""
    spec = _spec(tmp_path, "demo")
    argv = [a.format(out=tmp_path / "out", spec=spec) for a in args]
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer.pipeline.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "BrokenPipe" not in err
