"""The driver's view of the output store: fingerprint + job record, resume state, commits, _SUCCESS.

Wraps the commit protocol (commit.OutputStore, fingerprint.job_fingerprint) with what the driver knows:
the validated spec, the input listing and the resolved model directory. The spec recorded in _job.json
has secret-looking storage options redacted (the spec validator already refuses credentials there).
"""

from __future__ import annotations

import pyarrow as pa
from deepinfer.pipeline.output.commit import OutputStore, ResumeState, make_job_record
from deepinfer.pipeline.output.fingerprint import canonical_json, describe_inputs, job_fingerprint
from deepinfer.pipeline.output.storage import sha256_hex
from deepinfer.pipeline.parts import PartSpec
from deepinfer.pipeline.spec.load import JobSpec, redact
from deepinfer.pipeline.stages.read import InputFile, filesystem

# Runtime settings of this pipeline that cannot change output bytes, besides those the fingerprint module
# already ignores: a resume may change them freely.
EXTRA_NON_SEMANTIC_RUNTIME = ("sort_window", "engine_cpus", "max_batches_in_flight")


def fingerprint_document(document: dict) -> dict:
    """The spec document as fingerprinted: runtime knobs that do not change output bytes removed."""
    doc = dict(document)
    doc["runtime"] = {k: v for k, v in document.get("runtime", {}).items()
                      if k not in EXTRA_NON_SEMANTIC_RUNTIME}
    return doc


class JobStore:
    """One run's handle on its output; `resume` says what earlier runs left."""

    def __init__(self, store: OutputStore, resume: ResumeState, fingerprint: dict, fmt: str) -> None:
        self.store, self.resume, self.format = store, resume, fmt
        self.fingerprint = sha256_hex(canonical_json(fingerprint))

    @classmethod
    def open(cls, spec: JobSpec, listing: list[InputFile], parts: list[PartSpec], model_dir: str,
             restart: bool = False) -> JobStore:
        fs, _ = filesystem(spec.input.path, spec.input.storage_options)
        entries = []
        for f in listing:  # one root per file: a glob's files may sit in different subdirectories
            entries += describe_inputs(fs, [f.path], f.root, {f.path: f.num_rows})
        fingerprint = job_fingerprint(fingerprint_document(spec.document), model_dir, entries)
        record = make_job_record(redact(spec.document), fingerprint, parts, spec.output.format)
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

    def commit(self, part_id: str, rows: pa.Table, errors: pa.Table) -> bool:
        return self.store.commit_part(part_id, rows, errors, self.format)

    def write_success(self, summary: dict) -> None:
        self.store.write_success(summary)

    def close(self) -> None:
        self.store.close()
