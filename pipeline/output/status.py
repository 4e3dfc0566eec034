"""Progress and state of a job output, read from its commit markers, leases and run records only.

``deepinfer-job status OUTPUT_PATH|SPEC.yaml [--json]`` prints :func:`render_status` of :func:`job_status`.
Reading status never writes to the output (dead leases are left for the next run to remove).

States: ``empty`` (no ``_job.json``), ``complete`` (``_SUCCESS``), ``running`` (a live run lease),
``failed`` (the last run exited non-zero and wrote ``_FAILED``: exit code, reason, message), else
``interrupted`` (no live run, not complete, no failure recorded: killed or lost; a submit resumes it).
Counts come from the commit markers, so they grow part by part while a run commits.
"""

from __future__ import annotations

import json
import os
from typing import Any

import yaml
from deepinfer.pipeline.output import storage
from deepinfer.pipeline.output.layout import COMMITS_DIR, JOB_FILE, OutputReader
from deepinfer.pipeline.output.lease import LEASE_DIR, process_alive

STATES = ("empty", "running", "complete", "failed", "interrupted")
# Written by the driver (output/job_store.py); named here too so that status imports nothing heavy.
FAILED_FILE = "_FAILED"


def _output_url(target: str) -> str:
    if target.endswith((".yaml", ".yml")) and "://" not in target and os.path.isfile(target):
        try:
            with open(target, encoding="utf-8") as f:
                spec = yaml.safe_load(f)
            url = spec["output"]["path"]
        except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
            raise ValueError(f"{target}: cannot read output.path from this job spec ({exc})") from exc
        if not isinstance(url, str):
            raise ValueError(f"{target}: output.path must be a string")
        return url
    return target


def _live_writers(store: OutputReader, ttl_s: float = 120.0) -> tuple[int, int]:
    """(live runs, live committers): drivers, and the engine actors committing parts for them."""
    import time

    count = committers = 0
    directory = storage.join(store.root, LEASE_DIR)
    for name in storage.list_names(store.fs, directory):
        if not name.endswith(".json") or name.startswith(storage.TEMP_PREFIX):
            continue
        data = storage.read_bytes(store.fs, storage.join(directory, name))
        try:
            rec = json.loads(data or b"")
            alive = process_alive(rec["host"], int(rec["pid"]), rec.get("pid_start"), rec.get("pidns"))
            fresh = time.time() - float(rec["heartbeat"]) <= ttl_s
        except (ValueError, KeyError, TypeError):
            continue
        if alive or (alive is None and fresh):
            if rec.get("role") == "committer":
                committers += 1
            else:
                count += 1
    return count, committers


def _read_failure(store: OutputReader) -> dict[str, Any] | None:
    data = storage.read_bytes(store.fs, store.path(FAILED_FILE))
    try:
        record = json.loads(data) if data else None
    except ValueError:  # a torn or foreign file: report the job as failed, cause unknown
        record = {"exit_code": None, "reason": "unknown", "message": f"unreadable {FAILED_FILE}"}
    return record if isinstance(record, dict) else None


def job_status(target: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Status of the output at ``target`` (an output path/URL, or a job spec YAML naming one).

    Keys: output, state (one of :data:`STATES`), job_fingerprint (sha256 of the fingerprint, or None),
    total_parts, total_rows, committed_parts, committed_rows, error_rows, error_codes (code -> count),
    complete, live_runs, live_committers (engine actors committing parts for a live run), failure (the
    ``_FAILED`` record: exit_code, reason, message, finished_at, parts_committed; or None), summary (the
    _SUCCESS record, or None), numerics (the numerics stacks the committed parts were computed with,
    sorted: one for a deterministic job, output/numerics.py).
    """
    url = _output_url(target)
    store = OutputReader(*storage.open_fs(url, storage_options))
    job = store.read_job()
    markers = store.read_markers() if job is not None else {}
    codes: dict[str, int] = {}
    for marker in markers.values():
        for code, n in (marker.get("error_codes") or {}).items():
            codes[code] = codes.get(code, 0) + int(n)
    success = store.read_success()
    fp = None
    if job is not None:
        from deepinfer.pipeline.output.fingerprint import canonical_json

        fp = storage.sha256_hex(canonical_json(job.get("fingerprint")))
    complete = success is not None
    live, committers = _live_writers(store) if job is not None else (0, 0)
    failure = _read_failure(store) if job is not None and not complete else None
    if job is None:
        state = "empty"
    elif complete:
        state = "complete"
    elif live:
        state = "running"  # a live run wins over an old _FAILED: that run removes it when it starts
    else:
        state = "failed" if failure is not None else "interrupted"
    return {
        "output": url,
        "state": state,
        "job_fingerprint": fp,
        "total_parts": int(job["num_parts"]) if job else 0,
        "total_rows": int(job["num_rows"]) if job else 0,
        "committed_parts": len(markers),
        "committed_rows": sum(int(m.get("rows", 0)) for m in markers.values()),
        "error_rows": sum(int(m.get("error_rows", 0)) for m in markers.values()),
        "error_codes": dict(sorted(codes.items())),
        "complete": complete,
        "live_runs": live,
        "live_committers": committers,
        "failure": failure if state == "failed" else None,
        "summary": success,
        "numerics": sorted({str(s) for m in markers.values() for s in m.get("numerics") or []}),
    }


def render_status(status: dict[str, Any]) -> str:
    """A few human-readable lines for the CLI."""
    if status["state"] == "empty":
        return f"{status['output']}: no job here yet (no {JOB_FILE})"
    total_p, done_p = status["total_parts"], status["committed_parts"]
    total_r = status["total_rows"]
    done_r = status["committed_rows"] + status["error_rows"]
    pct = 100.0 * done_r / total_r if total_r else 100.0
    state = status["state"]
    if state == "failed" and status.get("failure"):
        fail = status["failure"]
        state += f" (exit {fail.get('exit_code')}, {fail.get('reason')}): {fail.get('message', '')}"
    elif state == "interrupted":
        state += " (no live run; submit again to resume)"
    lines = [
        f"output:   {status['output']}",
        f"state:    {state}" + (f" ({status['live_runs']} run(s) live)" if status["live_runs"] else ""),
        f"parts:    {done_p}/{total_p} committed (markers in {COMMITS_DIR}/)",
        f"rows:     {done_r}/{total_r} done ({pct:.1f}%): {status['committed_rows']} results, "
        f"{status['error_rows']} quarantined",
    ]
    if status["error_codes"]:
        lines.append("errors:   " + ", ".join(f"{c}={n}" for c, n in status["error_codes"].items()))
    lines.append(f"job:      fingerprint {str(status['job_fingerprint'])[:16]}")
    for i, stack in enumerate(status.get("numerics") or []):
        lines.append(("numerics: " if i == 0 else " " * 10) + stack)
    return "\n".join(lines)
