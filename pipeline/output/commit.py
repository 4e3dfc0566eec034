"""Exactly-once, kill-safe output commits: :class:`OutputStore` (layout: see layout.py).

The protocol. A part is committed exactly when its marker ``_commits/{part_id}.json`` exists; readers see
parts only through markers. ``commit_part`` writes the part's data objects under their final,
content-derived names (local: temp + fsync + rename; S3: one PUT each, never a rename), then creates the
marker, listing the objects with row counts and sha256, by an atomic put-if-absent.

* Killed before the marker: the part is not committed; its data objects are orphans, removed by the next
  run's cleanup or rewritten by it under the same names with the same bytes.
* Two runs committing one part: exactly one marker put succeeds; the loser returns False and deletes only
  its own objects the winner's marker does not reference (none, when outputs are deterministic).
* Names derive from content, so a deterministic job writes the same names and bytes on every run: a
  resumed output is byte-identical to an uninterrupted one (``_SUCCESS`` holds the run summary and is the
  only file that may differ).
* Orphan cleanup never races a live writer (lease protocol, lease.py); ``write_success`` sweeps what is
  left once every part is committed, so a finished output holds exactly what its markers reference.

Committers (worker_commit.py): on a Ray cluster the process that finishes a part commits it, not the
driver. Such a process joins the driver's run with :meth:`OutputStore.attach` (it checks that the output
still holds the driver's job, takes a lease of its own with role "committer", and waits while another run
cleans up, exactly as a run's first write does), then calls ``commit_part``. Every writer, driver or
committer, puts a marker only while its own lease has been fresh since it began the part's data writes
(``Lease.held_since``): a writer whose lease may have looked dead to another run's cleanup raises
RetryableError (exit 75) and commits nothing, its objects left as orphans.

Ownership (ownership.py): ``begin`` writes only into a new or empty directory, or one that already holds
a deepinfer job (its ``_job.json``); anything else is refused with exit 2 naming what is there, also with
``--restart``, which deletes only what this output's own manifest lists (markers and the objects they
reference, ``_SUCCESS``, ``_FAILED``, ``_job.json``, and orphans under deepinfer's own names).

Numerics (numerics.py): a deterministic job's parts all come from one numerics stack, recorded by its
first commit; a part from another is refused before it is written.

Fault injection: the protocol calls ``hooks.reached(point)`` at each of :data:`KILL_POINTS` when an
``OutputStore`` is given ``hooks`` (or ``OutputStore.default_hooks`` is set: only tests/support/kill_hooks.py
does); without one those calls do nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import pyarrow as pa
from deepinfer.pipeline.errors import ERROR_SCHEMA, FingerprintMismatch, RetryableError
from deepinfer.pipeline.output import ownership, storage
from deepinfer.pipeline.output.encoding import EXTENSIONS, check_format, encode_table
from deepinfer.pipeline.output.fingerprint import diff_fingerprints
from deepinfer.pipeline.output.job_record import ResumeState, make_job_record
from deepinfer.pipeline.output.layout import (
    COMMITS_DIR,
    ERRORS_DIR,
    JOB_FILE,
    NUMERICS_FILE,
    PARTS_DIR,
    SUCCESS_FILE,
    OutputReader,
    dumps,
)
from deepinfer.pipeline.output.lease import Lease, read_leases, remove_committers
from deepinfer.pipeline.output.numerics import OutputNumerics, enforced

KILL_POINTS = (
    "before_part_data_written",
    "after_part_data_written",  # data objects in place, marker not yet: leaves orphans
    "after_part_committed",
    "during_orphan_cleanup",  # after the first orphan was deleted
    "during_restart",  # after the first object of the old output was deleted
    "before_success",
)
__all__ = ["COMMITS_DIR", "KILL_POINTS", "CommitHooks", "OutputStore", "ResumeState", "make_job_record"]


class CommitHooks(Protocol):
    """A seam for fault injection: told each time the protocol reaches one of :data:`KILL_POINTS`."""

    def reached(self, point: str) -> None:
        """Called at `point`; may kill the process (tests do), must not change what is written."""


class OutputStore(OutputReader):
    """One job output (local path or s3://...); use it as a context manager so the run lease is released.

    A run calls ``begin`` -> ``commit_part`` for each part not in ``ResumeState.committed`` ->
    ``write_success`` (only when the job succeeded). Read-side methods come from OutputReader.
    """

    # Fault injection for every store of the process that is given no `hooks`: None in the product.
    default_hooks: CommitHooks | None = None

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        lease_ttl_s: float = 120.0,
        cleanup_wait_s: float = 600.0,
        hooks: CommitHooks | None = None,
    ) -> None:
        fs, root = storage.open_fs(url, storage_options)
        super().__init__(fs, root)
        self.url = url
        self._lease_ttl_s = lease_ttl_s
        self._cleanup_wait_s = cleanup_wait_s
        self._lease: Lease | None = None
        self._job: dict | None = None
        self._plan: dict[str, int] = {}
        self._hooks = hooks if hooks is not None else OutputStore.default_hooks
        self._created_job = False  # this run wrote _job.json (so may take it back: discard_if_unstarted)
        self.numerics: OutputNumerics | None = None  # the job's numerics stack, once begin/attach adopted it

    # ---- lifecycle ---------------------------------------------------------------------------------
    def begin(self, job_record: Mapping[str, Any], restart: bool = False) -> ResumeState:
        """Open the output for this job (record from :func:`make_job_record`); clean up after killed runs.

        Same fingerprint: resume (committed parts are kept; orphans of killed runs are removed). Finished
        job (``_SUCCESS`` present): returns ``complete=True`` having written nothing. Another fingerprint:
        raises :class:`~deepinfer.pipeline.errors.FingerprintMismatch` (exit 4) listing the differences,
        unless ``restart``, which deletes the old output (markers first, so nothing stays half-committed;
        safe to kill and repeat) and starts over. Storage failures raise RetryableStorageError (exit 75).
        """
        record = dict(job_record)
        for key in ("fingerprint", "parts", "format"):
            if key not in record:
                raise ValueError(f"job record lacks {key!r}; build it with make_job_record()")
        existing = ownership.check_output(self)  # exit 2 unless the path is new, empty or this job's
        if existing is not None and not restart:
            self._check_same_job(existing, record)
            if self.is_complete():
                self._adopt(existing)
                return ResumeState(frozenset(self.committed_part_ids()), True, True, False, 0)
        self._lease = Lease(self.fs, self.root, self._lease_ttl_s)
        self._lease.acquire()
        try:
            restarted = False
            if restart and existing is not None:
                if self._lease.others():
                    raise RetryableError(f"another run is live on {self.url}; cannot --restart it now")
                for path in ownership.manifest_objects(self):
                    if storage.remove(self.fs, path):
                        self._maybe_kill("during_restart")
                existing, restarted = None, True
            if storage.put_if_absent(self.fs, self.path(JOB_FILE), dumps(record)):
                self._created_job = True
            else:
                existing = self.read_job()  # a racing submit created it first
                self._check_same_job(existing or {}, record)
            self._adopt(existing if existing is not None else record)
            removed = self._cleanup(sweep=False)
            self._lease.wait_while_others_clean(self._cleanup_wait_s)
        except BaseException:
            with contextlib.suppress(Exception):  # keep the original failure, not a second one
                self.close()
            raise
        committed = frozenset(self.committed_part_ids())
        return ResumeState(committed, False, existing is not None and not restarted, restarted, removed)

    def attach(self, fingerprint: Mapping[str, Any], driver_run: str) -> None:
        """Join the run `driver_run` (a driver's lease run id) as a committer of its parts: the output must
        hold the job with `fingerprint` (else FingerprintMismatch: the output was restarted for another
        job meanwhile, and nothing may be committed into it); takes a committer lease and waits while
        another run cleans up. Then ``commit_part`` works as on the driver; ``close`` releases the lease."""
        existing = self.read_job()
        if existing is None or self.is_complete():
            raise RetryableError(f"{self.url} holds no unfinished job to commit parts of (it was removed or "
                                 "finished meanwhile)")
        diffs = diff_fingerprints(existing.get("fingerprint") or {}, fingerprint)
        if diffs:
            raise FingerprintMismatch(self.url, diffs)
        self._adopt(existing)
        self._lease = Lease(self.fs, self.root, self._lease_ttl_s, role="committer", driver=driver_run)
        self._lease.acquire()
        try:
            self._lease.wait_while_others_clean(self._cleanup_wait_s)
        except BaseException:
            self.close()
            raise

    @property
    def run_id(self) -> str | None:
        """This writer's lease id while it holds one (a driver hands it to its committers)."""
        return None if self._lease is None else self._lease.run_id

    def planned_rows(self, part_id: str) -> int | None:
        """Input rows of `part_id` in the job's plan (None: not a part of this job)."""
        return self._plan.get(part_id)

    def working_on(self, part_ids: Sequence[str]) -> None:
        """Say in this writer's lease which parts it works on now (status, debugging a cluster run)."""
        if self._lease is not None:
            self._lease.set_parts(list(part_ids))

    def _check_same_job(self, existing: Mapping, record: Mapping) -> None:
        diffs = diff_fingerprints(existing.get("fingerprint") or {}, record["fingerprint"])
        if not diffs and existing.get("format") != record.get("format"):
            diffs.append(f"output format: {existing.get('format')} -> {record.get('format')}")

        def plan(rec: Mapping) -> list:
            return [(p.get("part_id"), p.get("num_rows")) for p in rec.get("parts") or []]

        if not diffs and plan(existing) != plan(record):
            diffs.append("part plan differs (input row counts or rows_per_part changed)")
        if diffs:
            raise FingerprintMismatch(self.url, diffs)

    def _adopt(self, record: Mapping) -> None:
        self._job = dict(record)
        self._plan = {p["part_id"]: int(p["num_rows"]) for p in record["parts"]}
        self.numerics = OutputNumerics(self.fs, self.path(NUMERICS_FILE), self.url, enforced(record))

    @property
    def job(self) -> dict | None:
        """The job record in force (the existing ``_job.json`` when resuming), after ``begin``."""
        return self._job

    def discard_if_unstarted(self) -> bool:
        """Take back this run's ``_job.json`` when the job was refused before anything was committed (e.g.
        an engine that rejects its model settings): fixing the spec and submitting again to the same output
        path must then work, not meet a stale record of the refused spec (exit 4). True when removed."""
        if not self._created_job or self.committed_part_ids():
            return False
        if self._lease is None or self._lease.others():  # a racing run adopted this record: keep it
            return False
        for name in (SUCCESS_FILE, ownership.FAILED_FILE, NUMERICS_FILE, JOB_FILE):
            storage.remove(self.fs, self.path(name))
        self._created_job = False
        return True

    def close(self) -> None:
        """Release this run's lease (idempotent). Committed parts stay committed."""
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def __enter__(self) -> OutputStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- committing --------------------------------------------------------------------------------
    def commit_part(self, part_id: str, rows: pa.Table, errors: pa.Table | None, fmt: str,
                    input_rows: int | None = None, numerics: Sequence[str] = ()) -> bool:
        """Commit one part's result rows and error rows together, exactly once.

        ``rows`` and ``errors`` (:data:`~deepinfer.pipeline.errors.ERROR_SCHEMA`) are in input order and
        together account for every row of the part (ValueError otherwise). Returns True when this call
        committed the part, False when it already was committed (by an earlier or a racing run) — then
        nothing of the committed part is touched. ``input_rows``: how many input rows ``rows`` covers when
        that is not its row count (sampling.n > 1: one result row per sample); the marker's ``rows``
        counts input rows, each object's ``rows`` the rows in its file. ``numerics``: the stacks of the
        engines that generated the rows (numerics.part_stacks), checked against the job's before anything
        is written (NumericsMismatch in a deterministic job) and listed in the marker.
        """
        if self._job is None or self._lease is None or self.numerics is None:
            raise RuntimeError("call OutputStore.begin() first (no commits once the job is complete)")
        check_format(fmt)
        if fmt != self._job["format"]:
            raise ValueError(f"commit_part format {fmt!r} is not the job's format {self._job['format']!r}")
        if part_id not in self._plan:
            raise ValueError(f"part {part_id!r} is not in this job's part plan")
        n_err = 0 if errors is None else errors.num_rows
        n_rows = rows.num_rows if input_rows is None else input_rows
        if n_rows + n_err != self._plan[part_id]:
            raise ValueError(
                f"part {part_id} has {self._plan[part_id]} input rows but got {n_rows} result rows "
                f"+ {n_err} error rows; every row must end in exactly one of them"
            )
        if errors is not None and n_err and not errors.schema.equals(ERROR_SCHEMA):
            errors = errors.select(ERROR_SCHEMA.names).cast(ERROR_SCHEMA)
        if storage.read_bytes(self.fs, self.marker_path(part_id)) is not None:
            return False
        self.numerics.claim(part_id, list(numerics))
        since = time.monotonic()  # the fence: the lease must stay fresh from here to the marker
        self._maybe_kill("before_part_data_written")
        written = []
        for directory, table in [(PARTS_DIR, rows)] + ([(ERRORS_DIR, errors)] if n_err else []):
            data = encode_table(table, fmt)
            digest = storage.sha256_hex(data)
            rel = f"{directory}/{part_id}-{digest[:16]}.{EXTENSIONS[fmt]}"
            storage.write_atomic(self.fs, self.path(rel), data)
            written.append({"kind": directory, "path": rel, "rows": table.num_rows, "bytes": len(data),
                            "sha256": digest})
        self._maybe_kill("after_part_data_written")
        codes: dict[str, int] = {}
        for code in errors.column("code").to_pylist() if n_err else []:
            codes[code] = codes.get(code, 0) + 1
        marker = {"part_id": part_id, "format": fmt, "rows": n_rows, "error_rows": n_err,
                  "error_codes": codes, "objects": written}
        if numerics:
            marker["numerics"] = list(numerics)
        if not self._lease.held_since(since):
            raise RetryableError(f"part {part_id} of {self.url}: this writer's lease went stale while it "
                                 "wrote the part (storage unreachable or the process paused), so another "
                                 "run may have cleaned up its objects; not committing it (rerun to resume)")
        if not storage.put_if_absent(self.fs, self.marker_path(part_id), dumps(marker)):
            winner = self.read_marker(part_id) or {}
            keep = {o["path"] for o in winner.get("objects", [])}
            for obj in written:
                if obj["path"] not in keep:
                    storage.remove(self.fs, self.path(obj["path"]))
            return False
        self._maybe_kill("after_part_committed")
        return True

    def write_success(self, summary: Mapping[str, Any]) -> None:
        """Mark the job finished: every planned part must be committed. Sweeps leftovers, writes ``_SUCCESS``
        (``{"parts", "rows", "error_rows", "summary"}``) and releases the lease.

        Call only when the job succeeded (exit 0); with the error budget exceeded leave ``_SUCCESS`` out, so
        that a rerun reaches the same verdict instead of a no-op.
        """
        if self._job is None or self._lease is None:
            raise RuntimeError("call OutputStore.begin() first (and not on a job it found complete)")
        missing = sorted(set(self._plan) - self.committed_part_ids())
        if missing:
            raise RuntimeError(f"write_success with {len(missing)} uncommitted part(s), e.g. {missing[:3]}")
        self._cleanup(sweep=True)
        # Every part is committed: this run's committers can write nothing a marker does not reference.
        remove_committers(self.fs, self.root, self._lease.run_id)
        markers = self.read_markers()
        record = {
            "parts": len(markers),
            "rows": sum(int(m.get("rows", 0)) for m in markers.values()),
            "error_rows": sum(int(m.get("error_rows", 0)) for m in markers.values()),
            "summary": dict(summary),
        }
        self._maybe_kill("before_success")
        storage.write_atomic(self.fs, self.path(SUCCESS_FILE), dumps(record))
        self.close()

    # ---- cleanup -----------------------------------------------------------------------------------
    def cleanup_orphans(self) -> int:
        """Remove data objects no marker references (left by killed runs); returns how many were removed.

        Safe to kill at any point (each deletion is idempotent and never touches a committed object) and
        safe while other runs are live (it then removes nothing; see lease.py). ``begin`` already runs it.
        """
        if self._lease is None:
            raise RuntimeError("OutputStore.begin() must be called first")
        removed = self._cleanup(sweep=False)
        self._lease.wait_while_others_clean(self._cleanup_wait_s)
        return removed

    def _cleanup(self, sweep: bool) -> int:
        """Delete orphans. With ``sweep`` every part is committed, so every name a live racer could still
        write is referenced and no lease check is needed; otherwise the lease protocol decides."""
        lease = None if sweep else self._lease
        if lease is not None:
            lease.set_cleaning(True)
        try:
            candidates = self.find_orphans()  # snapshot BEFORE looking at leases (lease.py explains why)
            if lease is not None and lease.others():
                return 0
            removed = 0
            for path in candidates:
                if storage.remove(self.fs, path):
                    removed += 1
                    self._maybe_kill("during_orphan_cleanup")
            return removed
        finally:
            if lease is not None:
                lease.set_cleaning(False)

    def live_runs(self) -> list[dict]:
        """Lease records of the runs live on this output now (dead ones are removed on the way)."""
        return read_leases(self.fs, self.root, self._lease_ttl_s)

    # ---- fault injection seam -----------------------------------------------------------------------
    def _maybe_kill(self, point: str) -> None:
        if self._hooks is not None:
            self._hooks.reached(point)
