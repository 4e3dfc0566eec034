"""The driver of `deepinfer-job submit`: plan parts, skip committed ones, run an executor, commit parts.

Flow: list the input (sorted) -> plan parts -> open the output store (validates or writes _job.json; a
different job there is exit 4) -> clean up orphans of dead writers -> run the executor over the parts not yet
committed -> as each part's last row comes back, build its output and error tables and commit them
(exactly once, atomically) -> check the error budget over the whole job -> write _SUCCESS with the summary.

A part is committed the moment its rows are all back, so a killed run loses at most the parts in flight.
The error budget is judged over every row of the job (earlier runs' committed errors included); once the
quarantined rows exceed it the verdict cannot change, so the run stops early with exit 3.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deepinfer.pipeline.errors import ErrorBudget, ExitCode, SpecError
from deepinfer.pipeline.progress import ProgressDisplay
from deepinfer.pipeline.spec.load import JobSpec
from deepinfer.pipeline.stages.assemble import (
    PartAssembler,
    keep_types_from_jsonl,
    keep_types_from_parquet,
)
from deepinfer.pipeline.stages.plan import StagePlan, resolve_model_dir
from deepinfer.pipeline.stages.read import InputFile, list_input
from deepinfer.pipeline.summary import RunStats, format_summary, validate_summary


@dataclass(frozen=True)
class SubmitOptions:
    address: str | None = None
    restart: bool = False
    verbose: bool = False
    summary_json: str | None = None
    progress: bool = True


def check_model(spec: JobSpec) -> str:
    """Resolve the model directory and check what would otherwise fail in every worker (exit 2 early)."""
    field = "model.path" if spec.model.path is not None else "model.name"
    try:
        model_dir = resolve_model_dir(spec.model.ref)
    except ValueError as exc:
        raise SpecError([f"{field}: {exc}"]) from None
    from deepinfer.engine.text.tokenizer import Tokenizer
    from deepinfer.pipeline.stages.prompt import model_max_len

    try:
        tokenizer = Tokenizer.from_dir(model_dir)
        limit = model_max_len(model_dir, None)
    except ValueError as exc:
        raise SpecError([f"{field}: {exc}"]) from None
    if spec.prompt.mode == "chat" and tokenizer.chat_template is None:
        raise SpecError([f"prompt.mode: the model at {model_dir} has no chat template; use prompt.mode: raw"])
    if spec.model.max_model_len is not None and spec.model.max_model_len > limit:
        raise SpecError([f"model.max_model_len: {spec.model.max_model_len} exceeds the model's "
                         f"max_position_embeddings ({limit})"])
    return model_dir


def part_descriptors(listing: list[InputFile], planned: list[Any]) -> list[dict[str, Any]]:
    """The planned parts (parts.plan_parts over the listing) as the plain dicts the stages receive."""
    by_url = {f.url: f for f in listing}
    out = []
    for p in planned:
        f = by_url[p.file]
        if f.index != p.file_index:  # both sort the same listing; a mismatch would mislabel rows
            raise RuntimeError(f"part {p.part_id}: file index {f.index} != planned {p.file_index}")
        out.append({"part_id": p.part_id, "file_index": p.file_index, "url": f.url, "relpath": f.relpath,
                    "first_row": p.first_row, "num_rows": p.num_rows, "offset": f.offset_of(p.first_row)})
    return out


def plan_job(listing: list[InputFile], rows_per_part: int) -> list[Any]:
    from deepinfer.pipeline.parts import plan_parts

    return plan_parts([(f.url, f.num_rows) for f in listing], rows_per_part)


def _execute(spec: JobSpec, plan: StagePlan, parts: list[dict], options: SubmitOptions
             ) -> Iterator[pa.Table]:
    if spec.runtime.executor == "local":
        from deepinfer.pipeline.executors.local import run_local

        yield from run_local(plan, parts)
        return
    from deepinfer.pipeline.executors.ray_data import connect, run_ray

    session = connect(options.address, options.verbose)
    try:
        yield from run_ray(plan, parts, session, spec.runtime.engines, spec.runtime.engine_cpus,
                           spec.runtime.max_batches_in_flight)
    finally:
        session.close()


class PartCollector:
    """Gathers result rows per part; returns (part, rows) the moment the last distinct row of a part is back.

    Rows are keyed by input position, so a row delivered twice (a retried task) is kept once, and rows of an
    already completed part are ignored.
    """

    def __init__(self, parts: list[dict]) -> None:
        self.parts = {p["part_id"]: p for p in parts}
        self.rows: dict[str, list[pa.Table]] = {}
        self.seen: dict[str, set[int]] = {}
        self.done: set[str] = set()

    def add(self, batch: pa.Table) -> list[tuple[dict, pa.Table]]:
        complete = []
        ids = batch.column("__part")
        for part_id in sorted(set(ids.to_pylist())):
            if part_id in self.done:
                continue
            rows = batch.filter(pc.equal(ids, part_id))
            self.rows.setdefault(part_id, []).append(rows)
            self.seen.setdefault(part_id, set()).update(rows.column("__row").to_pylist())
            part = self.parts[part_id]
            if len(self.seen[part_id]) == part["num_rows"]:
                table = pa.concat_tables(self.rows.pop(part_id))
                if table.num_rows != part["num_rows"]:
                    table = _dedupe_rows(table)
                del self.seen[part_id]
                self.done.add(part_id)
                complete.append((part, table))
        return complete

    def pending(self) -> list[str]:
        return sorted(self.rows)


def _dedupe_rows(table: pa.Table) -> pa.Table:
    rows = table.column("__row").to_pylist()
    first: dict[int, int] = {}
    for i, r in enumerate(rows):
        first.setdefault(r, i)
    return table.take(pa.array(sorted(first.values()), type=pa.int64()))


def run_job(spec: JobSpec, options: SubmitOptions) -> int:
    """Run `spec` to completion; returns the exit code (0 or 3). Other failures raise."""
    from deepinfer.pipeline.output.job_store import JobStore

    model_dir = check_model(spec)
    listing = list_input(spec.input.path, spec.input.format, spec.input.storage_options,
                         stride=spec.runtime.rows_per_part)
    planned = plan_job(listing, spec.runtime.rows_per_part)
    parts = part_descriptors(listing, planned)
    store = JobStore.open(spec, listing, planned, model_dir, restart=options.restart)
    try:
        if store.complete:
            print(f"deepinfer-job: {spec.output.path} already holds this job, complete; nothing to do",
                  file=sys.stderr)
            summary = store.stored_summary()
            if summary is not None:
                _report(summary, options)
            return 0
        return _run_job(spec, options, store, parts, listing)
    finally:
        store.close()


def _run_job(spec: JobSpec, options: SubmitOptions, store: Any, parts: list[dict],
             listing: list[InputFile]) -> int:
    committed = store.committed()
    todo = [p for p in parts if p["part_id"] not in committed]
    stats = RunStats(rows_total=sum(p["num_rows"] for p in parts), parts_total=len(parts))
    stats.parts_resumed = len(parts) - len(todo)
    stats.rows_resumed = stats.rows_total - sum(p["num_rows"] for p in todo)
    stats.errored_resumed = store.committed_error_rows()
    stats.ok_resumed = stats.rows_resumed - stats.errored_resumed
    budget = ErrorBudget(spec.runtime.max_error_fraction)

    cols = [c for c in (spec.input.id_column, *spec.output.keep_columns) if c]
    if spec.input.format == "parquet":
        keep_types = keep_types_from_parquet([f.url for f in listing], cols, spec.input.storage_options)
    else:
        keep_types = keep_types_from_jsonl(listing, cols, spec.input.storage_options)
    assembler = PartAssembler(spec.id_column, spec.input.id_column is None, spec.output.keep_columns,
                              spec.output_schema, keep_types)
    if options.progress:
        print(f"[deepinfer] {stats.rows_total} rows in {len(parts)} parts; {stats.parts_resumed} parts "
              f"already committed; running {len(todo)} parts on the {spec.runtime.executor} executor",
              file=sys.stderr)
    progress = ProgressDisplay(stats.rows_total, stats.rows_resumed, len(parts), stats.parts_resumed,
                               label=spec.name or "deepinfer", enabled=options.progress)
    try:
        if budget.exceeded(stats.errored_total, stats.rows_total):
            exit_code = ExitCode.BUDGET
        else:
            exit_code = _run_parts(spec, todo, options, store, assembler, stats, budget, progress)
    finally:
        progress.close()
    summary = stats.summary(job=spec.name, output=spec.output.path, fingerprint=store.fingerprint,
                            max_fraction=spec.runtime.max_error_fraction, exit_code=exit_code)
    validate_summary(summary)
    if exit_code == 0:
        store.write_success(summary)
    _report(summary, options)
    if exit_code == ExitCode.BUDGET:
        print(f"deepinfer-job: error budget exceeded: {stats.errored_total} of {stats.rows_total} rows "
              f"quarantined, more than runtime.max_error_fraction={spec.runtime.max_error_fraction}; "
              f"see errors/ under {spec.output.path}", file=sys.stderr)
    return exit_code


def _run_parts(spec: JobSpec, todo: list[dict], options: SubmitOptions, store: Any,
               assembler: PartAssembler, stats: RunStats, budget: ErrorBudget,
               progress: ProgressDisplay) -> int:
    if not todo:
        return 0
    plan = StagePlan.from_spec(spec)
    collector = PartCollector(todo)
    results = _execute(spec, plan, todo, options)
    try:
        for batch in results:
            rows, errored, out_tokens = stats.add_batch(batch)
            progress.advance(rows, errored, out_tokens)
            for part, table in collector.add(batch):
                ok, errors = assembler.build(table)
                store.commit(part["part_id"], ok, errors)
                stats.parts_committed += 1
                progress.part_committed()
            if budget.exceeded(stats.errored_total, stats.rows_total):
                return ExitCode.BUDGET
    finally:
        close = getattr(results, "close", None)
        if close is not None:
            close()
    if collector.pending():
        raise RuntimeError(f"rows of parts {collector.pending()[:3]} never came back from the executor")
    return 0


def _report(summary: dict, options: SubmitOptions) -> None:
    print(format_summary(summary))
    if options.summary_json:
        with open(options.summary_json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
            f.write("\n")
