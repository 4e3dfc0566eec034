"""Committing a part where it finishes: the worker side of a Ray run (the protocol itself is commit.py's).

On a Ray run each engine actor commits the parts it generated, straight to the output's storage through
fsspec (S3, or a filesystem every node mounts: the driver's disk is never assumed), with the driver's
job record and a lease of its own (role "committer", `OutputStore.attach`): the same marker
put-if-absent (exactly once, whoever else races), the same content-derived names (byte-identical
output), the same lease fence (a committer whose lease may have looked dead commits nothing). Its lease
names the parts it works on, so `_runs/` shows which node has which part in flight.

What goes back to the driver is a report per part (:data:`REPORT_SCHEMA`): the rows' counting columns
(position, token counts, engine, timings, quarantine stage and code) with the result text, kept columns
and messages left null, and on the part's first row ``__commit``, JSON
``{"mine", "rows", "error_rows", "node", "committer"}``: whether this committer's marker won, the part's
committed counts, the Ray node id and engine that committed it. The driver counts reports into progress
and the run summary and writes only the job-level records (`_job.json`, `_SUCCESS`, `_FAILED`).

A block that holds only some rows of a part (Ray Data split it) cannot be committed where it is: it goes
back whole with ``__commit`` null, and the driver commits that part once all its rows are back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deepinfer.pipeline.output.commit import OutputStore
from deepinfer.pipeline.output.job_store import commit_outcome
from deepinfer.pipeline.output.lease import ray_node
from deepinfer.pipeline.output.numerics import part_stacks
from deepinfer.pipeline.stages import columns as C

REPORT_SCHEMA = C.ENGINE_SCHEMA.append(pa.field("__commit", pa.string()))
# What the driver counts of a committed part's rows (RunStats.add_batch, PartCollector, error counts).
_KEPT = frozenset({"__part", "__file", "__row", "__err_stage", "__err_code", "__plen", "__ntok", "__engine",
                   "__gen_s", "__t_first", "__spec", "__numerics"})


@dataclass(frozen=True)
class CommitTarget:
    """What a worker needs to commit parts of one run (picklable; travels to every engine actor).

    `fingerprint`: the job's fingerprint as in `_job.json` (a committer refuses an output that holds
    another job); `driver_run`: the driver's lease id (committer leases name it); `assembler`: the
    driver's PartAssembler (column types fixed from the whole input, runner.make_assembler)."""

    url: str
    storage_options: dict
    fingerprint: dict
    fmt: str
    driver_run: str
    assembler: Any


class PartCommitter:
    """One engine actor's committer: opened once per actor (its lease lives as long as the actor)."""

    def __init__(self, target: CommitTarget, committer: str) -> None:
        self.target, self.committer = target, committer
        self.store = OutputStore(target.url, target.storage_options)
        self.store.attach(target.fingerprint, target.driver_run)
        self.node = ray_node()

    def starting(self, batch: pa.Table) -> None:
        """Record in this committer's lease the parts of `batch`, before they are generated."""
        self.store.working_on(sorted(pc.unique(batch.column("__part")).to_pylist()))

    def commit(self, results: pa.Table) -> pa.Table:
        """Commit every part of `results` (ENGINE_SCHEMA) and return their reports; a block with an
        incomplete part comes back whole, uncommitted, for the driver (module docstring)."""
        ids = results.column("__part")
        present = sorted(pc.unique(ids).to_pylist())
        groups = [(p, results if len(present) == 1 else results.filter(pc.equal(ids, p))) for p in present]
        if not groups:
            return unreported(results)
        for part_id, rows in groups:
            distinct = pc.count_distinct(rows.column("__row")).as_py()
            if distinct != rows.num_rows or distinct != self.store.planned_rows(part_id):
                return unreported(results)
        reports = []
        for part_id, rows in groups:
            ok, errors = self.target.assembler.build(rows)
            outcome = commit_outcome(self.store, self.target.fmt, part_id, ok, errors, part_stacks(rows))
            info = {"mine": outcome.mine, "rows": outcome.rows, "error_rows": outcome.error_rows,
                    "node": self.node, "committer": self.committer}
            reports.append(_report(rows, json.dumps(info, sort_keys=True)))
        self.store.working_on([])
        return pa.concat_tables(reports)

    def close(self) -> None:
        self.store.close()


def _report(rows: pa.Table, info: str) -> pa.Table:
    n = rows.num_rows
    arrays = [rows.column(f.name) if f.name in _KEPT else pa.nulls(n, f.type) for f in C.ENGINE_SCHEMA]
    arrays.append(pa.array([info] + [None] * (n - 1), type=pa.string()))
    return pa.Table.from_arrays(arrays, schema=REPORT_SCHEMA)


def unreported(results: pa.Table) -> pa.Table:
    """ENGINE_SCHEMA rows as REPORT_SCHEMA rows that nobody committed yet (``__commit`` null)."""
    rows = results.select(C.ENGINE_SCHEMA.names).cast(C.ENGINE_SCHEMA)
    return rows.append_column(pa.field("__commit", pa.string()), pa.nulls(rows.num_rows, pa.string()))


def commit_report(part_rows: pa.Table) -> dict | None:
    """The worker's commit record among a part's rows (driver side), or None: not committed yet."""
    if "__commit" not in part_rows.column_names:
        return None
    found = pc.drop_null(part_rows.column("__commit")).to_pylist()
    return json.loads(found[0]) if found else None


def report_errors(part_rows: pa.Table) -> pa.Table:
    """The quarantined rows of a reported part as (stage, code) columns, for the summary's counts."""
    bad = part_rows.filter(pc.is_valid(part_rows.column("__err_stage")))
    return pa.table({"stage": bad.column("__err_stage"), "code": bad.column("__err_code")})
