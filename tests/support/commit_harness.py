"""A synthetic, deterministic job that drives :class:`OutputStore` directly (no model, no Ray).

Used by the commit-protocol tests in-process and in child processes (:func:`start_child`) that the tests
SIGKILL through ``DEEPINFER_TEST_KILL_AT``. Every row's result is a pure function of
(seed, row id); every 7th row is quarantined — so any two complete runs must give identical bytes.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from deepinfer.pipeline.errors import ErrorRow, JobError, error_table
from deepinfer.pipeline.output.commit import OutputStore, make_job_record
from deepinfer.pipeline.output.layout import OutputReader
from deepinfer.pipeline.output.storage import open_fs
from deepinfer.pipeline.parts import PartSpec, plan_parts, row_id

from tests.support import kill_hooks

LISTING = [("in/b.jsonl", 17), ("in/a.jsonl", 23), ("in/empty.jsonl", 0), ("in/c.jsonl", 9)]
ROWS_PER_PART = 5


def job(seed: int = 0, fmt: str = "parquet") -> tuple[list[PartSpec], dict]:
    parts = plan_parts(LISTING, ROWS_PER_PART)
    fingerprint = {"version": 1, "sampling": {"sha256": str(seed), "detail": {"seed": seed}}}
    return parts, make_job_record({"sampling": {"seed": seed}}, fingerprint, parts, fmt)


def all_ids() -> list[str]:
    return [row_id(p.file, i) for p in plan_parts(LISTING, ROWS_PER_PART) for i in p.row_range]


def part_tables(part: PartSpec, seed: int) -> tuple[pa.Table, pa.Table]:
    ids = [row_id(part.file, i) for i in part.row_range]
    bad = [i for i in ids if int(i.rsplit(":", 1)[1]) % 7 == 3]
    good = [i for i in ids if i not in bad]
    text = [hashlib.sha256(f"{seed}:{i}".encode()).hexdigest()[:12] for i in good]
    rows = pa.table({"id": good, "text": text, "n": [len(t) for t in text]})
    errors = error_table(ErrorRow(i, "validate", "INVALID_JSON", f"row {i}: not JSON") for i in bad)
    return rows, errors


def run(url: str, storage_options: dict | None = None, seed: int = 0, fmt: str = "parquet",
        order_seed: int | None = None, restart: bool = False) -> dict:
    """Run the synthetic job to completion; returns what happened."""
    parts, record = job(seed, fmt)
    with OutputStore(url, storage_options, hooks=kill_hooks.from_env()) as store:
        state = store.begin(record, restart=restart)
        if state.complete:
            return {"complete_before": True, "committed": 0, "orphans_removed": 0}
        todo = [p for p in parts if p.part_id not in state.committed]
        if order_seed is not None:
            random.Random(order_seed).shuffle(todo)
        won = 0
        for part in todo:
            rows, errors = part_tables(part, seed)
            won += store.commit_part(part.part_id, rows, errors, fmt)
        store.write_success({"job": "synthetic", "seed": seed})
    return {"complete_before": False, "committed": won, "orphans_removed": state.orphans_removed}


def _child(kwargs: dict, kill_at: str | None, env: dict, conn) -> None:
    os.setsid()  # own process group, as deepinfer-job runs in the chaos tests
    os.environ.update(env)
    os.environ.pop("DEEPINFER_TEST_KILL_AT", None)
    if kill_at:
        os.environ["DEEPINFER_TEST_KILL_AT"] = kill_at
    try:
        conn.send((0, run(**kwargs)))
    except JobError as exc:
        conn.send((exc.exit_code, str(exc)))
    conn.close()


@dataclass
class Child:
    """A run of :func:`run` in another process; ``wait()`` -> (exit code, result dict or error text)."""

    process: multiprocessing.process.BaseProcess
    conn: Any

    def wait(self, timeout: float = 120.0) -> tuple[int, Any]:
        result = None
        if self.conn.poll(timeout):
            try:
                result = self.conn.recv()
            except EOFError:  # killed before it could answer
                result = None
        self.process.join(timeout)
        if self.process.exitcode is None:
            self.process.kill()
            raise TimeoutError("harness child did not finish")
        if self.process.exitcode != 0 or result is None:
            return self.process.exitcode, None
        return result


def start_child(kwargs: dict, kill_at: str | None = None, env: dict | None = None) -> Child:
    """Start :func:`run` in a child of a forkserver that has the modules preloaded (fast, no threads
    inherited). ``kill_at`` sets the DEEPINFER_TEST_KILL_AT hook; a killed child exits with -9."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.commit_harness", "s3fs"])
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(kwargs, kill_at, env or {}, child), daemon=True)
    proc.start()
    child.close()
    return Child(proc, parent)


def run_child(kwargs: dict, kill_at: str | None = None, env: dict | None = None) -> tuple[int, Any]:
    return start_child(kwargs, kill_at, env).wait()


def snapshot(url: str, storage_options: dict | None = None) -> dict[str, bytes]:
    """Every object of an output except run leases: relative path -> bytes."""
    fs, root = open_fs(url, storage_options)
    reader = OutputReader(fs, root)
    return {rel: fs.cat_file(reader.path(rel)) for rel in reader.list_objects()}


def leases(url: str, storage_options: dict | None = None) -> list[str]:
    fs, root = open_fs(url, storage_options)
    try:
        return fs.ls(f"{root}/_runs", detail=False)
    except FileNotFoundError:
        return []
