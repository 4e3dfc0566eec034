"""The driver's view of the output store: fingerprint + job record, resume state, commits, _SUCCESS,
and the `_FAILED` record of a run that stopped with a non-zero exit code.

Wraps the commit protocol (commit.OutputStore, fingerprint.job_fingerprint) with what the driver knows:
the validated spec, the input listing and the resolved model directory. The spec recorded in _job.json
has secret-looking storage options redacted (the spec validator already refuses credentials there).

`_FAILED` (``{"exit_code", "reason", "message", "finished_at", "parts_committed"}``) is written by a driver
that exits non-zero after opening the output, and removed by the next run when it starts and again before
``_SUCCESS`` (a racing run may have failed meanwhile): `status` reads it to say *failed* rather than
*interrupted*. A SIGKILLed driver writes nothing, which is what *interrupted* means.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pyarrow as pa
from deepinfer.pipeline.errors import ExitCode, RetryableStorageError
from deepinfer.pipeline.output import status, storage
from deepinfer.pipeline.output.commit import OutputStore, ResumeState, make_job_record
from deepinfer.pipeline.output.fingerprint import canonical_json, describe_inputs, job_fingerprint
from deepinfer.pipeline.output.layout import dumps
from deepinfer.pipeline.output.storage import sha256_hex
from deepinfer.pipeline.parts import PartSpec
from deepinfer.pipeline.spec.load import JobSpec, redact
from deepinfer.pipeline.stages.read import InputFile, filesystem

# Runtime settings of this pipeline that cannot change output bytes, besides those the fingerprint module
# already ignores: a resume may change them freely.
EXTRA_NON_SEMANTIC_RUNTIME = ("sort_window", "engine_cpus", "max_batches_in_flight")
FAILED_FILE = status.FAILED_FILE
_REASONS = {ExitCode.BUDGET: "error_budget", ExitCode.USAGE: "spec", ExitCode.OTHER_JOB: "other_job",
            ExitCode.RETRY: "transient", ExitCode.BUG: "bug"}


def failure_reason(exit_code: int, exc: BaseException | None = None) -> str:
    """A one-word cause for `_FAILED`: error_budget, spec, storage, transient, other_job or bug."""
    seen = exc
    while seen is not None:  # storage failures are retryable ones; name them, they are fixed elsewhere
        if isinstance(seen, RetryableStorageError):
            return "storage"
        seen = seen.__cause__ or seen.__context__
    try:
        return _REASONS.get(ExitCode(exit_code), "bug")
    except ValueError:  # not one of the contract's codes
        return "bug"


@dataclass(frozen=True)
class CommitOutcome:
    """What committing one part did: `mine` when this run's marker won; else the winner's counts."""

    mine: bool
    rows: int
    error_rows: int


def fingerprint_document(document: dict) -> dict:
    """The spec document as fingerprinted: runtime knobs that do not change output bytes removed."""
    doc = dict(document)
    doc["runtime"] = {k: v for k, v in document.get("runtime", {}).items()
                      if k not in EXTRA_NON_SEMANTIC_RUNTIME}
    return doc


def input_rows_of(rows: pa.Table) -> int:
    """Input rows a result table covers: with sampling.n > 1 a row has one result row per sample (its
    sample 0 counts it), so markers, status and the error budget keep counting input rows."""
    if "sample_index" not in rows.column_names:
        return rows.num_rows
    return sum(1 for s in rows.column("sample_index").to_pylist() if s == 0)


def commit_outcome(store: OutputStore, fmt: str, part_id: str, rows: pa.Table, errors: pa.Table,
                   numerics: list[str]) -> CommitOutcome:
    """Commit a part through `store` (a driver's, or a committer's: worker_commit.py) exactly once;
    `numerics`: the stacks its rows were generated with (output/numerics.py)."""
    n_in = input_rows_of(rows)
    if store.commit_part(part_id, rows, errors, fmt, input_rows=n_in, numerics=numerics):
        return CommitOutcome(True, n_in, errors.num_rows)
    marker = store.read_marker(part_id) or {}
    return CommitOutcome(False, int(marker.get("rows", n_in)), int(marker.get("error_rows", errors.num_rows)))


class JobStore:
    """One run's handle on its output; `resume` says what earlier runs left."""

    def __init__(self, store: OutputStore, resume: ResumeState, fingerprint: dict, fmt: str) -> None:
        self.store, self.resume, self.format = store, resume, fmt
        self.fingerprint = sha256_hex(canonical_json(fingerprint))

    @classmethod
    def open(cls, spec: JobSpec, listing: list[InputFile], parts: list[PartSpec], model_dir: str,
             restart: bool = False, duplicates: dict[int, list[int]] | None = None) -> JobStore:
        """Open (or create) the output of this job. `duplicates` (file index -> duplicate-id rows, the
        verdict of stages/dedupe.py, a pure function of the fingerprinted input) is recorded in a new
        `_job.json` so that a resume can skip the id pass (runner.py); None records nothing."""
        fs, _ = filesystem(spec.input.path, spec.input.storage_options)
        entries = []
        for f in listing:  # one root per file: a glob's files may sit in different subdirectories
            entries += describe_inputs(fs, [f.path], f.root, {f.path: f.num_rows})
        fingerprint = job_fingerprint(fingerprint_document(spec.document), model_dir, entries)
        record = make_job_record(redact(spec.document), fingerprint, parts, spec.output.format)
        if duplicates is not None:
            record["duplicates"] = {str(k): list(v) for k, v in sorted(duplicates.items())}
        store = OutputStore(spec.output.path, spec.output.storage_options)
        resume = store.begin(record, restart=restart)
        return cls(store, resume, fingerprint, spec.output.format)

    @property
    def complete(self) -> bool:
        return self.resume.complete

    def committed(self) -> set[str]:
        return set(self.store.committed_part_ids())

    def committed_error_rows(self) -> int:
        return sum(int(m.get("error_rows", 0)) for m in self.store.read_markers().values())

    def stored_summary(self) -> dict | None:
        success = self.store.read_success()
        return success.get("summary") if isinstance(success, dict) else None

    def commit(self, part_id: str, rows: pa.Table, errors: pa.Table, numerics: list[str]) -> CommitOutcome:
        """Commit a part exactly once; a racing run that committed it first keeps it (and its counts)."""
        return commit_outcome(self.store, self.format, part_id, rows, errors, numerics)

    def expected_numerics(self) -> str | None:
        """The stack this job's engines must compute with (output/numerics.py), or None: a fast-mode
        job, or no part committed yet."""
        return None if self.store.numerics is None else self.store.numerics.expected()

    def write_success(self, summary: dict) -> None:
        self.clear_failure()
        self.store.write_success(summary)

    def record_failure(self, exit_code: int, reason: str, message: str, finished_at: str,
                       parts_committed: int) -> None:
        """Write `_FAILED` for a run ending with `exit_code`; never raises (the run's own error matters)."""
        record = {"exit_code": int(exit_code), "reason": reason, "message": message[:2000],
                  "finished_at": finished_at, "parts_committed": parts_committed}
        with contextlib.suppress(Exception):
            storage.write_atomic(self.store.fs, self.store.path(FAILED_FILE), dumps(record))

    def clear_failure(self) -> None:
        """Remove an earlier run's `_FAILED` (this run is live now, or the job just succeeded)."""
        storage.remove(self.store.fs, self.store.path(FAILED_FILE))

    def close(self) -> None:
        self.store.close()
