"""SIGTERM and SIGINT end a submit cleanly (defect 10): exit 75, one line, no stack dump, the lease
released; the next submit resumes and the output is byte-identical to an uninterrupted run's."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from deepinfer.pipeline.cli.main import main
from deepinfer.pipeline.output.lease import read_leases

from tests.support.cli_harness import reader, start_submit
from tests.support.pipeline_helpers import output_digest, review_rows, write_jsonl, write_spec


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_checkpoint) -> tuple[str, dict[str, str], Path]:
    root = tmp_path_factory.mktemp("signals")
    write_jsonl(root / "in.jsonl", review_rows(24))
    spec = write_spec(root / "job.yaml", {
        "model": {"path": str(tiny_checkpoint("llama"))},
        "input": {"path": str(root / "in.jsonl"), "format": "jsonl", "id_column": "rid"},
        "prompt": {"mode": "raw", "template": "{{ text }}"}, "sampling": {"max_tokens": 4, "seed": 5},
        "output": {"path": str(root / "reference"), "format": "parquet"},
        "runtime": {"executor": "local", "rows_per_part": 2, "batch_size": 2, "sort_window": 2},
    })
    assert main(["submit", spec]) == 0
    return spec, output_digest(root / "reference"), root


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_mid_run_exits_75_and_the_resume_is_byte_identical(job, signum) -> None:
    spec, reference, root = job
    url = str(root / f"out-{signum.name}")
    # Paused right after its first commit (a test-only hook), so the signal lands mid-run however fast the
    # machine finishes this tiny job; the test entry point also gives the submit Ctrl-C's default handler
    # even when this suite runs as a background job (tests/support/killable_cli.py).
    proc = start_submit(Path(spec), url, pause_at="after_part_committed:1")
    out = reader(url)
    deadline = time.monotonic() + 120
    while proc.poll() is None and not out.committed_part_ids() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the submit ended before its first commit was seen"
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    assert "Traceback" not in err and "resumes" in err
    assert not read_leases(out.fs, out.root, 120.0)  # the lease was released on the way out
    assert main(["submit", spec, "--set", f"output.path={url}"]) == 0
    assert output_digest(Path(url)) == reference
