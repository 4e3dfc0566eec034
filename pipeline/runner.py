"""The driver of `deepinfer-job submit`: plan parts, skip committed ones, run an executor, commit parts.

Flow: list the input (sorted) -> plan parts -> open the output store (validates or writes _job.json; a
different job there is exit 4) -> clean up orphans of dead writers -> run the executor over the parts not yet
committed -> as each part's last row comes back, build its output and error tables and commit them
(exactly once, atomically; on the Ray executor the engine actor that finished the part commits it on its
node and reports back, output/worker_commit.py) -> check the error budget over the whole job -> write
_SUCCESS with the summary.

A part is committed the moment its rows are all back, so a killed run loses at most the parts in flight.
The error budget is judged over every row of the job (earlier runs' committed errors included); once the
quarantined rows exceed it the verdict cannot change, so the run stops early with exit 3. A run that ends
non-zero once the output is open leaves `_FAILED` (job_store.py) for `status`; the next run removes it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import pyarrow as pa
from deepinfer.pipeline.errors import ErrorBudget, ExitCode, SpecError, classify_exception
from deepinfer.pipeline.evaluation import write_metrics
from deepinfer.pipeline.executors.engine_preload import EnginePreload, preload_for
from deepinfer.pipeline.output.job_store import CommitOutcome, JobStore, failure_reason
from deepinfer.pipeline.output.lease import ray_node
from deepinfer.pipeline.output.numerics import part_stacks
from deepinfer.pipeline.output.worker_commit import CommitTarget, commit_report, report_errors
from deepinfer.pipeline.part_collector import PartCollector  # noqa: F401 - re-exported (tests, benchmarks)
from deepinfer.pipeline.parts import PartSpec, PartTask, plan_parts
from deepinfer.pipeline.progress import ProgressDisplay
from deepinfer.pipeline.spec.load import JobSpec
from deepinfer.pipeline.stages.assemble import PartAssembler, keep_types_for
from deepinfer.pipeline.stages.plan import StagePlan, resolve_model_dir
from deepinfer.pipeline.stages.read import InputFile, list_input
from deepinfer.pipeline.summary import RunStats, format_summary, nothing_to_do, utc_now, validate_summary

if TYPE_CHECKING:
    from deepinfer.pipeline.executors.choice import ExecutorChoice
    from deepinfer.pipeline.executors.ray_start import RayStarter
    from deepinfer.pipeline.stages.generate import EngineCache


@dataclass(frozen=True)
class SubmitOptions:
    """The submit command's flags that are not part of the spec."""

    address: str | None = None
    restart: bool = False
    verbose: bool = False
    summary_json: str | None = None
    progress: bool = True
    # Replaces the spec's executor for this run (same signature as _execute): a sweep feeds its points
    # from one shared engine (sweep_run.py). None: the executor runtime.executor names.
    execute: Callable[[JobSpec, StagePlan, list[PartTask], SubmitOptions], Iterator[pa.Table]] | None = None
    # How runtime.executor was decided when the caller already did (a sweep resolves 'auto' once for all
    # its points, cli/main.py); used when it names the spec's executor, else run_job decides.
    executor_choice: ExecutorChoice | None = None
    # A local run's engine preload when the caller started it (cli/main.py); None: run_job may start one.
    engine_preload: EnginePreload | None = None
    # Engines already built for this local run (a --restart builds its engine before it deletes the old
    # output: executors/local.engines_before_restart). None: the executor builds them.
    engines: EngineCache | None = None


def check_model(spec: JobSpec) -> str:
    """Resolve the model directory and check what would otherwise fail in every worker (exit 2 early)."""
    field = "model.path" if spec.model.path is not None else "model.name"
    try:
        model_dir = resolve_model_dir(spec.model.ref)
    except ValueError as exc:
        raise SpecError([f"{field}: {exc}"]) from None
    from deepinfer.engine.models.loader import weight_files
    from deepinfer.engine.text.tokenizer import Tokenizer
    from deepinfer.pipeline.stages.prompt import model_max_len

    try:
        tokenizer = Tokenizer.from_dir(model_dir)
        limit = model_max_len(model_dir, None)
        weight_files(model_dir, spec.model.allow_pickle)  # a refused pickle checkpoint: exit 2 here
    except ValueError as exc:
        raise SpecError([f"{field}: {exc}"]) from None
    if spec.prompt.mode == "chat" and tokenizer.chat_template is None:
        raise SpecError([f"prompt.mode: the model at {model_dir} has no chat template; use prompt.mode: raw"])
    if spec.model.max_model_len is not None and spec.model.max_model_len > limit:
        raise SpecError([f"model.max_model_len: {spec.model.max_model_len} exceeds the model's "
                         f"max_position_embeddings ({limit})"])
    return model_dir


def part_tasks(listing: list[InputFile], planned: list[PartSpec]) -> list[PartTask]:
    """The planned parts (parts.plan_parts over the listing) joined with their files: what workers read."""
    by_url = {f.url: f for f in listing}
    out = []
    for p in planned:
        f = by_url[p.file]
        if f.index != p.file_index:  # both sort the same listing; a mismatch would mislabel rows
            raise RuntimeError(f"part {p.part_id}: file index {f.index} != planned {p.file_index}")
        out.append(PartTask(part_id=p.part_id, file_index=p.file_index, url=f.url, relpath=f.relpath,
                            first_row=p.first_row, num_rows=p.num_rows, offset=f.offset_of(p.first_row)))
    return out


def plan_job(listing: list[InputFile], rows_per_part: int) -> list[PartSpec]:
    return plan_parts([(f.url, f.num_rows) for f in listing], rows_per_part)


def make_assembler(spec: JobSpec, listing: list[InputFile]) -> PartAssembler:
    """The part assembler of `spec`'s job: column types fixed from the whole input (also used by verify,
    which must rebuild a row exactly as the run that committed it did)."""
    keep_types = keep_types_for(spec, listing)
    scorer = None
    if spec.eval is not None:
        from deepinfer.pipeline.evaluation import Scorer

        scorer = Scorer(spec.eval)
    batch_in = spec.input.format == "openai_batch"
    batch_output = None
    if spec.output.format == "openai_batch":
        from deepinfer.pipeline.stages.openai_batch_output import BatchOutput

        batch_output = BatchOutput(spec.model.name or spec.model.ref.rstrip("/").rsplit("/", 1)[-1])
    return PartAssembler(spec.id_column, spec.input.id_column is None, spec.output.keep_columns,
                         spec.output_schema, keep_types, scorer, samples=spec.sampling.n > 1 or batch_in,
                         logprobs=spec.sampling.logprobs is not None or batch_in,
                         prompt_logprobs=spec.sampling.prompt_logprobs is not None,
                         batch_output=batch_output)


def _execute(spec: JobSpec, plan: StagePlan, parts: list[PartTask], options: SubmitOptions,
             target: CommitTarget | None = None, starter: RayStarter | None = None) -> Iterator[pa.Table]:
    """The spec's executor over `parts`; with `target` a Ray run's engine actors commit the parts
    themselves (output/worker_commit.py) and return reports. A Ray run takes its session from `starter`
    (started with the run, shut down by run_job once the summary is out), else connects here."""
    if spec.runtime.executor == "local":
        from deepinfer.pipeline.executors.local import run_local

        preload = options.engine_preload  # Triton's import then goes beside the model build
        yield from run_local(plan, parts, options.engines,
                             on_imported=preload.engine_imported if preload else None)
        return
    from deepinfer.pipeline.executors.ray_data import EngineSettings, connect, run_ray

    session = starter.session() if starter is not None else connect(options.address, options.verbose)
    from deepinfer.pipeline.cli.main import install_signal_handlers

    install_signal_handlers()  # ray.init replaced the SIGTERM handler (exit 15 with a stack dump)
    settings = EngineSettings(spec.runtime.engines, spec.runtime.engine_cpus,
                              spec.runtime.max_batches_in_flight)
    try:
        yield from run_ray(plan, parts, session, settings, target)
    finally:
        if starter is None:
            session.close()


@dataclass
class RunContext:
    """What one run hands from set-up to the part loop (built once in _run_job)."""

    spec: JobSpec
    options: SubmitOptions
    store: JobStore
    assembler: PartAssembler
    stats: RunStats
    budget: ErrorBudget
    progress: ProgressDisplay
    starter: RayStarter | None = None


def run_job(spec: JobSpec, options: SubmitOptions) -> int:
    """Run `spec` to completion; returns the exit code (0 or 3). Other failures raise.

    Once the output is open, a run that ends with a non-zero code (returned or raised) leaves `_FAILED`
    with the code and its reason for `status`; KeyboardInterrupt and kills leave the job *interrupted*.
    """
    stats = RunStats(rows_total=0, parts_total=0)  # its clock starts before the model and input checks
    spec, choice = resolve_executor(spec, options)
    stats.executor = choice.section()
    preload = preload_for(spec, options.engine_preload, options.execute is not None)
    if preload is not None:  # the engine's native parts load on a thread while the input is planned
        stats.clock.preload, options = preload.marks, replace(options, engine_preload=preload)
    starter, attaching = None, False
    if spec.runtime.executor == "ray" and options.execute is None:  # Ray starts while the input is planned
        from deepinfer.pipeline.executors.ray_start import start_early

        starter, attaching = start_early(spec.output.path, spec.output.storage_options, options)
    try:
        return _check_and_run(spec, options, stats, starter, attaching)
    finally:
        if starter is not None:  # after the summary: the exit code is final, Ray's shutdown is not in it
            starter.close()


def resolve_executor(spec: JobSpec, options: SubmitOptions) -> tuple[JobSpec, ExecutorChoice]:
    """(`spec` with runtime.executor 'local' or 'ray', how it was chosen): 'auto' is decided by
    executors/choice.py, unless `options` carries the caller's decision for this executor."""
    from deepinfer.pipeline.executors.choice import choose_executor, with_executor

    choice = options.executor_choice
    if choice is None or choice.name != spec.runtime.executor:
        choice = choose_executor(spec, options.address)
    return with_executor(spec, choice), choice


def _check_and_run(spec: JobSpec, options: SubmitOptions, stats: RunStats, starter: RayStarter | None,
                   attaching: bool) -> int:
    model_dir = check_model(spec)
    if spec.runtime.executor == "ray":  # before anything is written: local paths on a multi-node cluster
        from deepinfer.pipeline.executors.ray_start import check_storage

        check_storage(spec.input.path, spec.output.path, spec.runtime.shared_filesystem, options.address,
                      options.verbose, starter, attaching)
    stats.clock.mark("model_checked")
    if spec.runtime.benchmark_stub_engine:
        print("[deepinfer] runtime.benchmark_stub_engine: PIPELINE BENCHMARK MODE, no model runs; every "
              "row's text is a placeholder (this output is fingerprinted as a stub job)", file=sys.stderr)
    from deepinfer.pipeline.output.ownership import stored_rows_per_part
    from deepinfer.pipeline.stages.dedupe import (
        find_duplicates,
        recordable,
        stored_duplicates,
        with_duplicates,
    )

    # A resume keeps the split into parts of the run that started the output (rows_per_part is a
    # runtime setting and may differ between a run and its resume).
    stored = None if options.restart else stored_rows_per_part(spec.output.path, spec.output.storage_options)
    rows_per_part = stored or spec.runtime.rows_per_part
    listing = list_input(spec.input.path, spec.input.format, spec.input.storage_options,
                         stride=rows_per_part, on_bad_file=spec.input.on_bad_file)
    planned = plan_job(listing, rows_per_part)
    tasks = part_tasks(listing, planned)
    # The duplicate-id verdict reads every id of the input (the one pass over all rows a resume would
    # repeat); the first run records it in _job.json and a resume reuses it. Safe: it is a function of
    # the input alone, and JobStore.open refuses (exit 4) a recorded job whose fingerprint differs,
    # before any part runs.
    duplicates = None if stored is None else stored_duplicates(spec)
    if duplicates is None and spec.input.id_column is not None:
        duplicates = find_duplicates(listing, spec.input.format, spec.input.id_column,
                                     spec.input.storage_options, on_bad_file=spec.input.on_bad_file)
    parts = with_duplicates(tasks, duplicates) if duplicates else tasks
    record = duplicates if duplicates is not None and recordable(duplicates) else None
    if options.restart and options.execute is None and spec.runtime.executor == "local":
        from deepinfer.pipeline.executors.local import engines_before_restart

        options = replace(options, engines=options.engines or engines_before_restart(spec))
    store = JobStore.open(spec, listing, planned, model_dir, restart=options.restart, duplicates=record)
    stats.clock.mark("output_opened")
    try:
        if store.complete:
            print(f"deepinfer-job: {spec.output.path} already holds this job, complete; nothing to do",
                  file=sys.stderr)
            summary = store.stored_summary()
            if summary is not None:   # the job's totals; this call's own figures (it did nothing)
                _report(nothing_to_do(summary, stats), options)
            return 0
        store.clear_failure()
        stats.rows_total, stats.parts_total = sum(p.num_rows for p in parts), len(parts)
        try:
            code = _run_job(spec, options, store, parts, listing, stats, starter)
        except Exception as exc:
            code, message = classify_exception(exc)
            store.record_failure(code, failure_reason(code, exc), message, utc_now(), stats.parts_committed)
            if code == ExitCode.USAGE:  # refused before anything was committed: take back _job.json
                store.store.discard_if_unstarted()
            raise
        if code != ExitCode.OK:
            message = (f"error budget exceeded: {stats.errored_total} of {stats.rows_total} rows "
                       f"quarantined, more than runtime.max_error_fraction={spec.runtime.max_error_fraction}")
            store.record_failure(code, failure_reason(code), message, utc_now(), stats.parts_committed)
        return code
    finally:
        store.close()


def _run_job(spec: JobSpec, options: SubmitOptions, store: JobStore, parts: list[PartTask],
             listing: list[InputFile], stats: RunStats, starter: RayStarter | None = None) -> int:
    committed = store.committed()
    todo = [p for p in parts if p.part_id not in committed]
    stats.parts_resumed = len(parts) - len(todo)
    stats.rows_resumed = stats.rows_total - sum(p.num_rows for p in todo)
    stats.errored_resumed = store.committed_error_rows()
    stats.ok_resumed = stats.rows_resumed - stats.errored_resumed
    budget = ErrorBudget(spec.runtime.max_error_fraction)

    assembler = make_assembler(spec, listing)
    if options.progress:
        print(f"[deepinfer] {stats.rows_total} rows in {len(parts)} parts; {stats.parts_resumed} parts "
              f"already committed; running {len(todo)} parts on the {spec.runtime.executor} executor",
              file=sys.stderr)
    progress = ProgressDisplay(stats.rows_total, stats.rows_resumed, len(parts), stats.parts_resumed,
                               label=spec.name or "deepinfer", enabled=options.progress)
    ctx = RunContext(spec, options, store, assembler, stats, budget, progress, starter)
    try:
        if budget.exceeded(stats.errored_total, stats.rows_total):
            exit_code = ExitCode.BUDGET
        else:
            exit_code = _run_parts(ctx, todo)
    finally:
        progress.close()
    summary = stats.summary(job=spec.name, output=spec.output.path, fingerprint=store.fingerprint,
                            max_fraction=spec.runtime.max_error_fraction, exit_code=exit_code)
    validate_summary(summary)
    if exit_code == 0:
        if spec.eval is not None:  # from the committed parts: the same bytes however the run went
            write_metrics(spec.eval, store)
        store.write_success(summary)
    _report(summary, options)
    if exit_code == ExitCode.BUDGET:
        print(f"deepinfer-job: error budget exceeded: {stats.errored_total} of {stats.rows_total} rows "
              f"quarantined, more than runtime.max_error_fraction={spec.runtime.max_error_fraction}; "
              f"see errors/ under {spec.output.path}", file=sys.stderr)
    return exit_code


def commit_target(ctx: RunContext) -> CommitTarget:
    """What a Ray run's engine actors need to commit their parts where they finish (worker_commit.py)."""
    store = ctx.store.store
    if store.job is None or store.run_id is None:
        raise RuntimeError("the output store must be open (JobStore.open) before the executor starts")
    return CommitTarget(ctx.spec.output.path, dict(ctx.spec.output.storage_options),
                        dict(store.job["fingerprint"]), ctx.store.format, store.run_id, ctx.assembler)


def _commit_here(ctx: RunContext, part: PartTask, table: pa.Table) -> tuple[CommitOutcome, pa.Table]:
    """Commit a part on the driver (local executor; a Ray part whose rows came back split)."""
    ok, errors = ctx.assembler.build(table)
    outcome = ctx.store.commit(part.part_id, ok, errors, part_stacks(table))
    if outcome.mine:
        rows = outcome.rows + outcome.error_rows
        ctx.stats.add_commit_place(part.part_id, rows, "driver", ray_node(), None)
    return outcome, errors


def _run_parts(ctx: RunContext, todo: list[PartTask]) -> int:
    """Stream the executor's results; count each part as it is committed — by the engine actor that
    finished it (Ray) or here the moment its rows are all back (local executor)."""
    if not todo:
        return 0
    collector = PartCollector(todo)
    plan = replace(StagePlan.from_spec(ctx.spec), numerics=ctx.store.expected_numerics())
    clock = ctx.stats.clock
    clock.mark("executor_requested")
    if ctx.options.execute is not None:
        results = ctx.options.execute(ctx.spec, plan, todo, ctx.options)
    else:
        target = commit_target(ctx) if ctx.spec.runtime.executor == "ray" else None
        results = _execute(ctx.spec, plan, todo, ctx.options, target, ctx.starter)
    try:
        for batch in results:
            clock.mark("first_result")  # the first time only
            rows, out_tokens = ctx.stats.add_batch(batch)
            ctx.progress.advance(rows, 0, out_tokens)
            for part, table in collector.add(batch):
                report = commit_report(table)
                if report is None:
                    outcome, errors = _commit_here(ctx, part, table)
                else:
                    outcome = CommitOutcome(bool(report["mine"]), int(report["rows"]),
                                            int(report["error_rows"]))
                    errors = report_errors(table)
                    if outcome.mine:
                        ctx.stats.add_commit_place(part.part_id, outcome.rows + outcome.error_rows, "worker",
                                                   report.get("node"), report.get("committer"))
                ctx.stats.add_commit(outcome.rows, errors, outcome.mine, outcome.error_rows)
                ctx.progress.part_committed(outcome.error_rows)
            if ctx.budget.exceeded(ctx.stats.errored_total, ctx.stats.rows_total):
                return ExitCode.BUDGET
        clock.mark("last_result")
    finally:
        close = getattr(results, "close", None)
        if close is not None:
            close()
        clock.mark("results_closed")
        if ctx.starter is not None and ctx.starter.ready_at is not None:
            clock.driver.setdefault("executor_started", ctx.starter.ready_at)
    if collector.pending():
        raise RuntimeError(f"rows of parts {collector.pending()[:3]} never came back from the executor")
    return 0


def _report(summary: dict, options: SubmitOptions) -> None:
    print(format_summary(summary))
    if options.summary_json:
        with open(options.summary_json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
            f.write("\n")
