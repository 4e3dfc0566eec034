"""`deepinfer-job verify OUTPUT --sample N [--seed S]`: recompute committed rows and compare them.

The product promises byte-identical rows; this checks the promise on a job that already ran. It reads
`_job.json` (resolved spec + part plan), rebuilds the same stages in this process (read -> prompt ->
tokenize -> one engine -> assemble), runs exactly the sampled rows through them and compares every
serialized field of each row with the committed one. Running only the sampled rows is itself part of the
test: the engine is batch-invariant, so a row must not depend on which rows shared its batch.

Which rows: every committed result row of the job, in part order, then `random.Random(seed).sample` of
them, so one (N, seed) always picks the same rows. An object whose bytes no longer match the sha256 in its
commit marker (changed after commit) is a mismatch on its own; its rows are still read and compared, so
the diff names the row and field that changed.

Exit codes: 0 every sampled row matches; 5 (ExitCode.VERIFY_MISMATCH) some row or object differs; 2 the
output holds no job, or its input changed since the job ran (rows can then not be located).
"""

from __future__ import annotations

import math
import random
import sys
from dataclasses import dataclass, field
from typing import Any, TextIO

import pyarrow as pa
import pyarrow.compute as pc
from deepinfer.pipeline.errors import ExitCode, SpecError
from deepinfer.pipeline.output import storage
from deepinfer.pipeline.output.encoding import decode_table, encode_table
from deepinfer.pipeline.output.layout import OutputReader
from deepinfer.pipeline.parts import PartSpec, PartTask
from deepinfer.pipeline.spec.load import JobSpec

MAX_SHOWN = 200  # characters of a value shown in a diff line


@dataclass
class CommittedRow:
    """One committed result row: its part, its id (canonical text) and its decoded fields."""

    part_id: str
    row_id: str
    fields: dict[str, Any]
    sample: int | None = None  # sample_index of a row of sampling.n > 1 (one committed row per sample)
    numerics: tuple[str, ...] = ()  # the stacks its part was computed with (its marker's "numerics")


@dataclass
class VerifyReport:
    """What verify found; `problems` are the readable diff lines (empty when everything matched)."""

    committed_rows: int = 0
    sampled: list[CommittedRow] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    mismatched_rows: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return ExitCode.VERIFY_MISMATCH if self.problems else ExitCode.OK


def _canonical_id(value: Any) -> str:
    return "" if value is None else str(value)


def read_committed_rows(reader: OutputReader, id_column: str, report: VerifyReport) -> list[CommittedRow]:
    """Every committed result row, in part order. Objects that fail their marker's sha256 are reported
    and still read (a tampered file's rows are what the diff should name)."""
    rows: list[CommittedRow] = []
    for part_id, marker in reader.read_markers().items():
        for obj in marker.get("objects", []):
            if obj["kind"] != "parts":
                continue
            data = storage.read_bytes(reader.fs, reader.path(obj["path"]))
            if data is None:
                report.problems.append(f"part {part_id}: {obj['path']} (in its commit marker) is missing")
                continue
            if storage.sha256_hex(data) != obj["sha256"]:
                report.problems.append(f"part {part_id}: {obj['path']} does not match the sha256 in its "
                                       "commit marker (the file changed after it was committed)")
            try:
                table = decode_table(data, marker["format"])
            except Exception as exc:   # a committed file that no longer decodes: its rows differ
                why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
                report.problems.append(f"part {part_id}: {obj['path']} cannot be read as {marker['format']} "
                                       f"({why})")
                continue
            stacks = tuple(marker.get("numerics") or ())
            for values in table.to_pylist():
                rows.append(CommittedRow(part_id, _canonical_id(values.get(id_column)), values,
                                         values.get("sample_index"), stacks))
    return rows


def _same(a: Any, b: Any) -> bool:
    """Equal values of equal types (True != 1, 0.0 vs -0.0 distinguished; NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 1] + "…"


def compare_row(committed: CommittedRow, recomputed: dict[str, Any] | None, error: str | None) -> list[str]:
    """Diff lines for one row (empty when every field is identical)."""
    where = f"row {committed.row_id!r} (part {committed.part_id})"
    if recomputed is None:
        return [f"{where}: recomputed row was quarantined instead ({error})"]
    out = []
    for name in sorted(set(committed.fields) | set(recomputed)):
        if name not in recomputed:
            out.append(f"{where}: field {name!r} is committed but not recomputed")
        elif name not in committed.fields:
            out.append(f"{where}: field {name!r} is recomputed but not committed")
        elif not _same(committed.fields[name], recomputed[name]):
            out.append(f"{where}: field {name!r}: committed {_show(committed.fields[name])} != recomputed "
                       f"{_show(recomputed[name])}")
    return out


def _job_tasks(spec: JobSpec, record: dict, report: VerifyReport) -> tuple[dict[str, PartTask], list]:
    """The job's part tasks (duplicates marked) from the recorded part plan, and today's input listing."""
    from deepinfer.pipeline.runner import part_tasks
    from deepinfer.pipeline.stages.dedupe import mark_duplicates
    from deepinfer.pipeline.stages.read import list_input

    planned = [PartSpec.from_dict(d) for d in record["parts"]]
    stride = int(spec.runtime.rows_per_part)
    listing = list_input(spec.input.path, spec.input.format, spec.input.storage_options,
                         stride=stride, on_bad_file=spec.input.on_bad_file)
    try:
        tasks = part_tasks(listing, planned)
    except (KeyError, RuntimeError):
        raise SpecError([f"input.path: the input at {spec.input.path} no longer has the files the job ran "
                         "on; verify recomputes rows from the job's own input"]) from None
    _check_fingerprint(spec, record, listing, report)
    return {t.part_id: t for t in mark_duplicates(spec, listing, tasks)}, listing


def _check_fingerprint(spec: JobSpec, record: dict, listing: list, report: VerifyReport) -> None:
    """An input that changed is an error (rows cannot be located); other differences (model files,
    deepinfer version) are notes: recomputing under them is what a verify may be asked to check."""
    from deepinfer.pipeline.output.fingerprint import describe_inputs, diff_fingerprints, job_fingerprint
    from deepinfer.pipeline.output.job_store import fingerprint_document
    from deepinfer.pipeline.stages.plan import resolve_model_dir
    from deepinfer.pipeline.stages.read import filesystem

    fs, _ = filesystem(spec.input.path, spec.input.storage_options)
    entries = []
    for f in listing:
        entries += describe_inputs(fs, [f.path], f.root, {f.path: f.num_rows})
    now = job_fingerprint(fingerprint_document(spec.document), resolve_model_dir(spec.model.ref), entries)
    stored = record.get("fingerprint") or {}
    if stored.get("input") != now.get("input"):
        raise SpecError([f"input.path: the input changed since the job ran: "
                         f"{'; '.join(diff_fingerprints(stored, now))}"])
    report.notes += [f"differs from the run: {d}" for d in diff_fingerprints(stored, now)]


def recompute(spec: JobSpec, tasks: dict[str, PartTask], listing: list, rows: list[CommittedRow],
              notes: list[str],
              ) -> dict[tuple[str, str, int | None], tuple[dict[str, Any] | None, str | None]]:
    """(part id, row id, sample index or None) -> (recomputed output row decoded like a committed one, or
    None and the error; a quarantined row is entered under sample None). A note is added to `notes` when
    this machine's engine computes with another numerics stack than the rows' parts were."""
    from deepinfer.pipeline.output.numerics import bracketed
    from deepinfer.pipeline.runner import make_assembler
    from deepinfer.pipeline.stages.plan import StagePlan, prepare_part

    plan = StagePlan.from_spec(spec)
    assembler = make_assembler(spec, listing)
    engine = plan.engine_stage()
    stacks = sorted({s for r in rows for s in r.numerics})
    if engine.numerics is not None and any(s != engine.numerics for s in stacks):
        notes.append(f"the sampled rows were computed with {bracketed(stacks)}, this machine computes "
                     f"with {bracketed([engine.numerics])}: a row that differs may differ for that reason "
                     "alone (deterministic output holds on one numerics stack)")
    wanted: dict[str, set[str]] = {}
    for r in rows:
        wanted.setdefault(r.part_id, set()).add(r.row_id)
    out: dict[tuple[str, str, int | None], tuple[dict[str, Any] | None, str | None]] = {}
    for part_id in sorted(wanted):
        prepared = prepare_part(plan, tasks[part_id])
        # only the rows the run processed carry their id without an error (duplicates are quarantined)
        live = pc.and_(pc.is_in(prepared.column("__row_id"), pa.array(sorted(wanted[part_id]))),
                       pc.is_null(prepared.column("__err_stage")))
        ok, errors = assembler.build(engine.generate_part(prepared.filter(live), plan.batch_size))
        fmt = spec.output.format
        # through the output encoding and back: compare what a reader of the committed file sees
        decoded = decode_table(encode_table(ok, fmt), fmt).to_pylist() if ok.num_rows else []
        for values in decoded:
            out[(part_id, _canonical_id(values.get(spec.id_column)), values.get("sample_index"))] = (values,
                                                                                                  None)
        for e in errors.to_pylist():
            why = f"stage {e['stage']}, code {e['code']}: {e['message']}"
            out.setdefault((part_id, e["id"], None), (None, why))
    return out


def verify_output(url: str, sample: int, seed: int = 0, storage_options: dict | None = None) -> VerifyReport:
    """Recompute `sample` committed rows of the job at `url` (chosen by `seed`) and compare them."""
    fs, root = storage.open_fs(url, storage_options)
    reader = OutputReader(fs, root)
    record = reader.read_job()
    if record is None:
        from deepinfer.pipeline.sweep import POINTS_DIR, read_sweep

        hint = (f"; it is a sweep: verify one of its points, {url.rstrip('/')}/{POINTS_DIR}/<point-id>"
                if read_sweep(url, storage_options) is not None else "")
        raise SpecError([f"OUTPUT: {url} holds no deepinfer job (no _job.json){hint}"])
    spec = JobSpec.from_document(record["spec"])
    report = VerifyReport()
    rows = read_committed_rows(reader, spec.id_column, report)
    report.committed_rows = len(rows)
    chosen = sorted(random.Random(seed).sample(range(len(rows)), min(sample, len(rows))))
    report.sampled = [rows[i] for i in chosen]
    if not report.sampled:
        return report
    tasks, listing = _job_tasks(spec, record, report)
    results = recompute(spec, tasks, listing, report.sampled, report.notes)
    for row in report.sampled:
        recomputed, error = results.get((row.part_id, row.row_id, row.sample),
                                        results.get((row.part_id, row.row_id, None),
                                                    (None, "the row was not recomputed")))
        diff = compare_row(row, recomputed, error)
        if diff:
            report.mismatched_rows.add(row.row_id)
            report.problems += diff
    return report


def print_report(url: str, report: VerifyReport, seed: int, out: TextIO | None = None) -> None:
    """The human-readable result: notes, then the diff lines, then a one-line verdict."""
    out = out or sys.stdout  # looked up per call: tests and in-process callers swap sys.stdout
    for note in report.notes:
        print(f"note: {note}", file=out)
    for line in report.problems:
        print(f"MISMATCH {line}", file=out)
    n = len(report.sampled)
    if not report.problems:
        print(f"{url}: {n} of {report.committed_rows} committed rows recomputed (seed {seed}): "
              "all byte-identical", file=out)
    else:
        print(f"{url}: {len(report.mismatched_rows)} of {n} recomputed rows differ, "
              f"{len(report.problems)} problems (seed {seed})", file=out)
