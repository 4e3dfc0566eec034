"""Committing parts where they finish (output/worker_commit.py), without a cluster: a committer joins a
driver's run through its own lease, commits each part exactly once with the driver's protocol, reports
back what the driver counts, leaves a split part to the driver, and is fenced by its lease.

In-process on local disk with the synthetic job of tests/support/commit_harness.py (milliseconds); the
same code runs in engine actors on worker nodes in tests/pipeline/test_ray_cluster.py.
"""

from __future__ import annotations

import json
import time

import pyarrow as pa
import pytest
from deepinfer.pipeline.errors import FingerprintMismatch, NumericsMismatch, RetryableError
from deepinfer.pipeline.output.commit import OutputStore
from deepinfer.pipeline.output.worker_commit import (
    CommitTarget,
    PartCommitter,
    commit_report,
    report_errors,
)
from deepinfer.pipeline.stages import columns as C

from tests.support import commit_harness as H


class HarnessAssembler:
    """The synthetic job's tables for a part (stands in for the driver's PartAssembler)."""

    def __init__(self, parts) -> None:
        self.parts = {p.part_id: p for p in parts}

    def build(self, results: pa.Table) -> tuple[pa.Table, pa.Table]:
        return H.part_tables(self.parts[results.column("__part")[0].as_py()], 0)


def engine_rows(part, rows: range | None = None, numerics: str | None = None) -> pa.Table:
    rows = part.row_range if rows is None else rows
    n = len(rows)
    return C.table({"__part": [part.part_id] * n, "__file": [part.file_index] * n, "__row": list(rows),
                    "__text": ["x"] * n, "__ntok": [1] * n, "__plen": [3] * n, "__engine": ["e@n"] * n,
                    "__gen_s": [0.01] * n, "__numerics": [numerics] * n}, C.ENGINE_SCHEMA)


def leases(url) -> list[dict]:
    runs = (url / "_runs")
    return [json.loads(p.read_text()) for p in sorted(runs.glob("*.json"))] if runs.exists() else []


@pytest.fixture()
def driver(tmp_path):
    parts, record = H.job()
    store = OutputStore(str(tmp_path / "out"))
    store.begin(record)
    target = CommitTarget(str(tmp_path / "out"), {}, record["fingerprint"], "parquet", store.run_id,
                          HarnessAssembler(parts))
    yield store, parts, target
    store.close()


def test_a_committer_commits_each_part_once_and_reports_what_the_driver_counts(driver, tmp_path) -> None:
    store, parts, target = driver
    one, other = PartCommitter(target, "engine-a"), PartCommitter(target, "engine-b")
    part = parts[0]
    one.starting(engine_rows(part))
    (mine,) = [r for r in leases(tmp_path / "out") if r["run_id"] == one.store.run_id]
    assert (mine["role"], mine["driver"], mine["parts"]) == ("committer", store.run_id, [part.part_id])
    report = one.commit(engine_rows(part))
    info = commit_report(report)
    ok, errors = H.part_tables(part, 0)
    assert info == {"mine": True, "rows": ok.num_rows, "error_rows": errors.num_rows, "node": None,
                    "committer": "engine-a"}
    assert report.column("__text").null_count == report.num_rows  # no result text travels back
    assert report_errors(report).num_rows == 0  # these rows carry no quarantine columns
    assert store.read_marker(part.part_id)["rows"] == ok.num_rows
    # a retried task on another engine finds the part committed: nothing changes, it says so
    again = commit_report(other.commit(engine_rows(part)))
    assert (again["mine"], again["rows"], again["committer"]) == (False, ok.num_rows, "engine-b")
    # a block with only some rows of a part goes back uncommitted, for the driver
    split = other.commit(engine_rows(parts[1], parts[1].row_range[:2]))
    assert commit_report(split) is None and store.read_marker(parts[1].part_id) is None
    assert split.column("__text").to_pylist() == ["x", "x"]
    for p in parts[1:]:
        one.commit(engine_rows(p))
    one.close()  # `other` never says goodbye, as Ray may end an actor: the driver removes its lease
    store.write_success({"job": "synthetic", "seed": 0})  # what commit_harness.run writes
    assert leases(tmp_path / "out") == []
    assert H.snapshot(str(tmp_path / "out")) == H.snapshot(_reference(tmp_path))


def _reference(tmp_path) -> str:
    url = str(tmp_path / "ref")
    H.run(url)
    return url


def test_committers_on_two_numerics_stacks_commit_only_the_first_ones_parts(driver) -> None:
    store, parts, target = driver  # the synthetic job is deterministic (model.deterministic defaults on)
    here, there = PartCommitter(target, "engine-a"), PartCommitter(target, "engine-b")
    assert commit_report(here.commit(engine_rows(parts[0], numerics="cpu A")))["mine"]
    with pytest.raises(NumericsMismatch, match=r"computed with \[cpu A\].*\[cuda B\]"):
        there.commit(engine_rows(parts[1], numerics="cuda B"))
    assert store.read_marker(parts[1].part_id) is None
    assert commit_report(here.commit(engine_rows(parts[1], numerics="cpu A")))["mine"]
    assert [store.read_marker(p.part_id)["numerics"] for p in parts[:2]] == [["cpu A"], ["cpu A"]]
    here.close()
    there.close()


def test_a_committer_refuses_an_output_that_holds_another_job(driver) -> None:
    _, _, target = driver
    other = CommitTarget(target.url, {}, {**target.fingerprint, "sampling": {"sha256": "9"}}, "parquet",
                         target.driver_run, target.assembler)
    with pytest.raises(FingerprintMismatch):
        PartCommitter(other, "engine-a")


def test_a_writer_whose_lease_went_stale_commits_nothing(driver) -> None:
    store, parts, target = driver
    committer = PartCommitter(target, "engine-a")
    lease = committer.store._lease
    lease._last_ok = time.monotonic() - lease.ttl_s  # heartbeats failed: others may judge it dead
    with pytest.raises(RetryableError, match="lease went stale"):
        committer.commit(engine_rows(parts[0]))
    assert store.read_marker(parts[0].part_id) is None
    lease._write()  # a heartbeat gets through again, but the gap spans any part begun before it
    assert not lease.held_since(time.monotonic() - 1.0) and lease.held_since(time.monotonic())
    assert commit_report(committer.commit(engine_rows(parts[0])))["mine"] is True
    committer.close()


def test_a_removed_committer_lease_stays_removed_and_fences_its_writer(tmp_path) -> None:
    from deepinfer.pipeline.output.lease import Lease
    from deepinfer.pipeline.output.storage import open_fs

    fs, root = open_fs(str(tmp_path / "out"))
    # A TTL a loaded 2-core CI machine keeps: with 0.2 s (fresh means written in the last 0.1 s) the first
    # check below failed once when the process was not scheduled for 0.1 s.
    ttl = 2.0
    lease = Lease(fs, root, ttl_s=ttl, role="committer", driver="d")
    lease.acquire()
    assert lease.held_since(time.monotonic() - 0.01)
    fs.rm(lease.path)  # its driver finished the job (or another run judged it dead)
    deadline = time.monotonic() + 30
    while lease.held_since(0.0) and time.monotonic() < deadline:  # the next heartbeat notices
        time.sleep(0.05)
    time.sleep(ttl)  # four more heartbeats (every ttl / 4) would have written it again by now
    assert not fs.exists(lease.path) and not lease.held_since(0.0)
    lease.set_parts(["00000-0000000000"])  # a lost lease writes nothing more
    assert not fs.exists(lease.path)
    lease.release()
