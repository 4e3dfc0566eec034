"""The run summary's `startup` figures (startup_clock.StartupClock): where a run's fixed cost goes.

Engine figures ride to the driver on the first row of each part's `__spec` JSON (generate.with_timing),
merged with the MTP figures already there; the driver sums them and reports marks as seconds since the
run's clock started. End to end here on the local executor (in-process, a few seconds); the Ray path is
checked by tests/pipeline/test_incremental_commits.py on the shared Ray.
"""

from __future__ import annotations

import json
import time

import pyarrow as pa
from deepinfer.pipeline.cli.main import main
from deepinfer.pipeline.stages import columns as C
from deepinfer.pipeline.stages.generate import with_timing
from deepinfer.pipeline.summary import RunStats, StartupClock, process_started_epoch, validate_summary

from tests.support.pipeline_helpers import write_jsonl, write_spec
from tests.support.startup_checks import check_startup


def _engine_rows(n: int, spec: list[str | None]) -> pa.Table:
    cols = {"__part": ["p0"] * n, "__row": list(range(n)), "__plen": [3] * n, "__ntok": [2] * n,
            "__engine": ["e1"] * n, "__gen_s": [0.1] * n, "__t_first": [None] * n, "__spec": spec}
    return C.table(cols, C.ENGINE_SCHEMA)


def test_with_timing_merges_into_the_first_rows_mtp_figures() -> None:
    mtp = json.dumps({"drafted": 4, "accepted": 3})
    out = with_timing(_engine_rows(3, [mtp, None, None]), {"engine": "e1", "wait_s": 0.5})
    specs = out.column("__spec").to_pylist()
    assert json.loads(specs[0]) == {"drafted": 4, "accepted": 3, "timing": {"engine": "e1", "wait_s": 0.5}}
    assert specs[1:] == [None, None]
    assert out.schema == C.ENGINE_SCHEMA
    assert with_timing(_engine_rows(0, []), {"x": 1}).num_rows == 0


def test_clock_counts_first_part_wait_as_startup_and_later_waits_as_idle() -> None:
    t0 = time.time()
    clock = StartupClock()
    marks = {"process": t0 + 1, "init": t0 + 2, "imported": t0 + 3, "built": t0 + 5, "ready": t0 + 6}
    clock.add({"engine": "a", "received": t0 + 7, "wait_s": 1.0, "generate_s": 2.0, "commit_s": 0.25,
               "startup": marks, "cuda_graph_capture_s": 1.5})
    clock.add({"engine": "a", "received": t0 + 9.5, "wait_s": 0.25, "generate_s": 2.0, "commit_s": 0.25})
    clock.mark("model_checked")
    s = clock.section(t0, first_token=t0 + 7.5, first_commit=9.25, wall=12.0)
    assert (s["engine_process_started_s"], s["engine_actor_started_s"], s["engine_imported_s"],
            s["model_loaded_s"], s["engine_ready_s"]) == (1.0, 2.0, 3.0, 5.0, 6.0)
    assert s["first_part_received_s"] == 7.0 and s["first_token_s"] == 7.5 and s["first_commit_s"] == 9.25
    assert s["engine_wait_s"] == 0.25  # the first part's wait is engine_ready_s -> first_part_received_s
    assert s["engine_generate_s"] == 4.0 and s["engine_commit_s"] == 0.5 and s["cuda_graph_capture_s"] == 1.5
    assert s["model_checked_s"] is not None and s["executor_started_s"] is None
    started = process_started_epoch()
    assert started is None or started <= time.time()


def test_summary_carries_timing_from_spec_rows_and_validates() -> None:
    stats = RunStats(rows_total=2, parts_total=1)
    now = time.time()
    timing = {"engine": "e1", "received": now, "wait_s": 0.0, "generate_s": 0.5, "commit_s": 0.0,
              "startup": {"init": now - 1, "built": now - 0.5, "ready": now - 0.4}}
    stats.add_batch(_engine_rows(2, [json.dumps({"timing": timing}), None]))
    summary = stats.summary(job=None, output="x", fingerprint=None, max_fraction=0.0, exit_code=0)
    validate_summary(summary)
    assert summary["startup"]["engine_generate_s"] == 0.5
    assert summary["speculative"]["drafted_tokens"] == 0  # timing alone is not MTP figures


def test_local_job_reports_ordered_startup_figures(tmp_path, model_dir, capsys) -> None:
    inp = tmp_path / "in.jsonl"
    write_jsonl(inp, [{"rid": f"r{i}", "text": f"item {i}"} for i in range(6)])
    out = tmp_path / "out"
    doc = {"model": {"path": model_dir}, "input": {"path": str(inp), "format": "jsonl", "id_column": "rid"},
           "prompt": {"mode": "raw", "template": "{{ text }}"},
           "sampling": {"temperature": 0, "max_tokens": 3, "ignore_eos": True},
           "output": {"path": str(out), "format": "jsonl"},
           "runtime": {"executor": "local", "rows_per_part": 2, "batch_size": 2}}
    assert main(["submit", write_spec(tmp_path / "job.yaml", doc)]) == 0
    summary = json.loads((out / "_SUCCESS").read_text())["summary"]
    s = check_startup(summary, ray=False)
    assert s["engine_generate_s"] <= summary["wall_seconds"]
    assert "startup" in capsys.readouterr().out
