"""`deepinfer-job`: validate, submit and inspect batch inference jobs.

Exit codes (a contract, DESIGN.md): 0 done (errors within budget) · 2 invalid spec or usage · 3 error
budget exceeded · 4 output path holds another job · 5 verify found a differing row · 75 retryable failure
(storage, engine, infrastructure: run the same command again) · 1 bug (a short message; the traceback
with -v, which every command has).

SIGTERM is handled like Ctrl-C (SIGINT): the main thread gets a KeyboardInterrupt, the run stops
cleanly (committed parts are kept; the lease is released on the way out) and exits 75 with one line
instead of a stack dump, so a scheduler's kill is a retry like any other transient failure.

Imports stay lazy: `validate` never imports torch or ray.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import Any

from deepinfer.pipeline.errors import ExitCode

EPILOG = """\
examples:
  deepinfer-job validate jobs/labeling.yaml
  deepinfer-job validate jobs/s3_job.yaml --set output.path=s3://bucket/run-2/
  deepinfer-job submit jobs/labeling.yaml --set output.path=/tmp/labels --summary-json /tmp/summary.json
  deepinfer-job submit jobs/eval_sweep.yaml --address ray://head:10001 --set sampling.seed=7
  deepinfer-job submit jobs/labeling.yaml --restart        # discard this job's committed output, start over
  deepinfer-job status /tmp/labels --json
  deepinfer-job status jobs/labeling.yaml
  deepinfer-job plan jobs/labeling.yaml --json            # rows, tokens, quarantines, engine-hours
  deepinfer-job verify /tmp/labels --sample 20 --seed 1   # recompute 20 committed rows, compare bytes
  deepinfer-job report out/eval                             # metrics of an eval job or a sweep

exit codes: 0 done · 2 invalid spec/usage · 3 error budget exceeded · 4 output holds another job ·
            5 verify found a row that differs · 75 retryable failure (run it again: it resumes) · 1 bug
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepinfer-job", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Run offline batch LLM inference jobs described by a YAML spec "
                    "(schemas/job.schema.json).",
    )
    sub = parser.add_subparsers(dest="command", metavar="{validate,submit,status,plan,verify,report}")
    sub.required = True

    def add_set(p: argparse.ArgumentParser) -> None:
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a spec field, e.g. --set output.path=s3://b/out (value parsed as YAML; "
                            "repeatable)")

    p = sub.add_parser("validate", formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="check a spec (no Ray, no model): exit 0 or 2 naming the bad field",
                       epilog="example:\n  deepinfer-job validate jobs/labeling.yaml --set runtime.engines=2")
    p.add_argument("spec", metavar="SPEC", help="job spec YAML file")
    add_set(p)
    p.add_argument("--print", dest="print_resolved", action="store_true",
                   help="print the resolved spec (defaults filled, paths absolute) as JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks of unexpected errors")

    p = sub.add_parser("submit", formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="run a job to completion (resumes committed work by default)",
                       epilog="example:\n  deepinfer-job submit jobs/labeling.yaml "
                              "--set output.path=/tmp/out "
                              "--summary-json /tmp/summary.json")
    p.add_argument("spec", metavar="SPEC", help="job spec YAML file")
    add_set(p)
    p.add_argument("--summary-json", metavar="PATH", help="also write the run summary as JSON to PATH")
    p.add_argument("--address", metavar="RAY_ADDRESS",
                   help="attach to this Ray cluster (default: $RAY_ADDRESS, else start a local Ray)")
    p.add_argument("--restart", action="store_true",
                   help="discard the committed output of this output path and start from scratch (the "
                        "in-process executor builds its engine first: a refused model setting keeps it)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show Ray's logs and progress bars, and tracebacks of unexpected errors")

    p = sub.add_parser("status", formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="show how far a job has got (from its output path or its spec)",
                       epilog="examples:\n  deepinfer-job status /tmp/labels\n"
                              "  deepinfer-job status jobs/labeling.yaml --json")
    p.add_argument("target", metavar="OUTPUT|SPEC", help="an output path (local or s3://) or a job spec YAML")
    add_set(p)
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks of unexpected errors")

    p = sub.add_parser("plan", formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="read and tokenize the input (no weights): rows, token counts, quarantines, "
                            "engine-hours",
                       epilog="example:\n  deepinfer-job plan jobs/labeling.yaml --json")
    p.add_argument("spec", metavar="SPEC", help="job spec YAML file")
    add_set(p)
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks of unexpected errors")

    p = sub.add_parser("verify", formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="recompute committed rows and check they are byte-identical (exit 5 if not)",
                       epilog="example:\n  deepinfer-job verify /tmp/labels --sample 20 --seed 1")
    p.add_argument("output", metavar="OUTPUT", help="a job's output path (local or s3://)")
    p.add_argument("--sample", type=_positive_int, default=10, metavar="N",
                   help="how many committed rows to recompute (default 10; all when fewer)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="seed of the row choice: the same N and S always pick the same rows (default 0)")
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks of unexpected errors")

    p = sub.add_parser("report", formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="print the metrics of an eval job (metrics.json) or a sweep (metrics.parquet)",
                       epilog="example:\n  deepinfer-job report out/eval --json")
    p.add_argument("output", metavar="OUTPUT", help="the output path of an eval job or a sweep")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks of unexpected errors")
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _err(message: str) -> None:
    from deepinfer.pipeline.spec.secrets import redact_text

    print(f"deepinfer-job: {redact_text(message)}", file=sys.stderr)


class Terminated(KeyboardInterrupt):
    """SIGTERM, delivered to the main thread as an interrupt (so `finally` blocks and context managers
    release leases and engines exactly as for Ctrl-C)."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def install_signal_handlers() -> None:
    """Make SIGTERM end the run like SIGINT. Idempotent; only possible in the main thread. Ray's
    ray.init installs its own SIGTERM handler (exit 15 with a C++ stack dump), so the driver calls this
    again after connecting."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
        # SIGINT already raises KeyboardInterrupt unless a library reset it to the C default; an ignored
        # SIGINT (a job started in the background by a shell) stays ignored, as the shell meant.
        if signal.getsignal(signal.SIGINT) is signal.SIG_DFL:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def cmd_validate(args: argparse.Namespace) -> int:
    import json

    from deepinfer.pipeline.spec.load import load_spec

    spec = load_spec(args.spec, args.overrides)
    if args.print_resolved:
        print(json.dumps(spec.document, indent=2, sort_keys=True))
    else:
        model = spec.model.name or spec.model.path
        schema = "with output_schema" if spec.output_schema is not None else "free text"
        if spec.sweep is not None:
            from deepinfer.pipeline.sweep import point_specs

            schema += f", a sweep of {len(point_specs(spec))} points"
        print(f"{args.spec}: valid job spec (model {model}, {spec.input.format} input {spec.input.path}, "
              f"{spec.output.format} output {spec.output.path}, {schema})")
    return ExitCode.OK


def cmd_submit(args: argparse.Namespace) -> int:
    from deepinfer.pipeline.executors.choice import choose_executor, sweep_with_executor, with_executor
    from deepinfer.pipeline.spec.load import load_spec

    spec = load_spec(args.spec, args.overrides)
    if args.summary_json:   # checked before the job runs, not found out after it
        _check_summary_path(args.summary_json)
    # Decided once, here (a sweep: for every point; their specs are rebuilt from the document, which then
    # names the executor), so that a local run's engine starts loading (executors/engine_preload.py) as
    # soon as the driver's own extension modules are in, beside the rest of its work.
    choice = choose_executor(spec, args.address)
    from deepinfer.pipeline.runner import SubmitOptions, run_job

    preload = None
    if spec.sweep is None:
        from deepinfer.pipeline.executors.engine_preload import start_for_submit

        spec = with_executor(spec, choice)
        preload = start_for_submit(spec)
    options = SubmitOptions(address=args.address, restart=args.restart, verbose=args.verbose,
                            summary_json=args.summary_json, executor_choice=choice, engine_preload=preload)
    if spec.sweep is not None:
        from deepinfer.pipeline.sweep import run_sweep

        return run_sweep(sweep_with_executor(spec, choice), options)
    return run_job(spec, options)


def _check_summary_path(path: str) -> None:
    """SpecError unless --summary-json PATH can be written: not a directory, in an existing, writable one."""
    from deepinfer.pipeline.errors import SpecError

    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise SpecError([f"--summary-json {path}: is a directory; give a file path"])
    if not os.path.isdir(parent):
        raise SpecError([f"--summary-json {path}: the directory {parent} does not exist"])
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise SpecError([f"--summary-json {path}: not writable"])


def cmd_status(args: argparse.Namespace) -> int:
    from deepinfer.pipeline.cli.status_cmd import show_status

    return show_status(args.target, args.overrides, as_json=args.json)


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from deepinfer.pipeline.job_plan import plan_spec, render_plan
    from deepinfer.pipeline.spec.load import load_spec

    plan = plan_spec(load_spec(args.spec, args.overrides))
    print(json.dumps(plan, indent=2, sort_keys=True) if args.json else render_plan(plan))
    return ExitCode.OK


def cmd_report(args: argparse.Namespace) -> int:
    from deepinfer.pipeline.cli.sweep_cmds import report

    return report(args.output, as_json=args.json)


def cmd_verify(args: argparse.Namespace) -> int:
    from deepinfer.pipeline.verify import print_report, verify_output

    report = verify_output(args.output, args.sample, args.seed)
    print_report(args.output, report, args.seed)
    return report.exit_code


def classify(exc: BaseException) -> tuple[int, str]:
    """(exit code, one-line message) for an exception that ended a command."""
    from deepinfer.pipeline.errors import classify_exception

    return classify_exception(exc)


# Commands that only read and print: a closed stdout (`| head`) ends them with exit 0.
READ_ONLY_COMMANDS = ("validate", "status", "plan", "report")


def _silence_stdout() -> None:
    """Point stdout at /dev/null (its reader went away), so that no later flush fails too. A read-only
    command meets a raw BrokenPipeError only on stdout: storage errors come wrapped (output/storage.py)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):   # no real stdout (an in-process caller's capture): nothing to redirect
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code (also when called in-process)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    handlers = {"validate": cmd_validate, "submit": cmd_submit, "status": cmd_status,
                "plan": cmd_plan, "verify": cmd_verify, "report": cmd_report}
    verbose = getattr(args, "verbose", False)
    previous = signal.getsignal(signal.SIGTERM)
    install_signal_handlers()
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt as exc:
        what = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
        _err(f"{what}; committed parts are kept and the next submit resumes from them")
        return ExitCode.RETRY
    except Exception as exc:  # RecursionError and MemoryError included: never a traceback
        # `deepinfer-job status ... | head`: the reader of a read-only command's output stopped reading,
        # which is no failure (a submit or verify keeps the meaning of its exit code).
        if isinstance(exc, BrokenPipeError) and args.command in READ_ONLY_COMMANDS:
            _silence_stdout()
            return ExitCode.OK
        code, message = classify(exc)
        _err(message)
        if code == ExitCode.BUG:
            if verbose:
                traceback.print_exception(exc, file=sys.stderr)
            else:
                _err(f"this is a bug in deepinfer; rerun `deepinfer-job {args.command}` with -v for the "
                     "traceback and report it")
        elif verbose:
            traceback.print_exception(exc, file=sys.stderr)
        return code
    finally:
        # main() is also called in-process (tests, Airflow): leave the caller's handler as it was.
        if threading.current_thread() is threading.main_thread() and previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


def console_main() -> None:
    """The `deepinfer-job` console command: `main`, then the process ends at once with its exit code.

    When `main` returns, the command's work is on disk and closed: committed parts, `_SUCCESS`, metrics and
    the summary JSON are written by fsynced atomic publishes (pipeline/output/storage.py) and closed before
    the summary is printed, and a local Ray the run started is already shut down (runner.run_job). What the
    interpreter would still do is tear down its modules (Ray's and Arrow's native state: 1-2 s measured
    after a submit), which no output depends on. So the standard streams are flushed and the process leaves
    with os._exit. `main` itself returns normally, so in-process callers keep their process.
    """
    code = main()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(int(code))
