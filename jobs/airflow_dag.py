"""Example Airflow 3 DAG: one deepinfer job per day, retried only when the CLI says a retry can help.

Deploy
------
1. Install deepinfer where the Airflow workers run, so that `deepinfer-job` is on the workers' PATH, or
   set `DEEPINFER_JOB_BIN` in the workers' environment to its full path (e.g. a separate virtualenv's
   `bin/deepinfer-job`: deepinfer need not share Airflow's environment, and this file never imports it).
2. Copy this file into the DAGs folder (or a DAG bundle). It needs Airflow 3 (`airflow.sdk`); without
   Airflow it still imports, defining only the helpers below, so the project never depends on Airflow.
3. Ray: by default each run starts its own local Ray on the worker. To attach to a running cluster, set
   `DEEPINFER_RAY_ADDRESS` in the workers' environment or the Airflow Variable `deepinfer_ray_address`
   (e.g. `ray://head:10001`); the task passes it as `--address` (and `RAY_ADDRESS`). Nothing attaches by
   default, not even through a `RAY_ADDRESS` the worker inherited: a worker that happens to sit next to
   some Ray cluster must not silently run jobs on it.
4. Adjust the params' defaults (spec, input/output paths, job name) or override them per run
   (`airflow dags trigger deepinfer_review_labeling --conf '{"output_path": "s3://b/rerun/"}'`). `{ds}`
   and `{ds_nodash}` in a param are replaced by the run's logical date.
5. Try it on a worker with `airflow dags test deepinfer_review_labeling`; tests/pipeline/test_airflow_dag.py
   runs it under Airflow 3 against a stand-in `deepinfer-job` for every exit code.

Retries follow the CLI's exit codes (deepinfer-job's contract): 75 is a transient failure (storage, engine,
infrastructure) and the task raises an ordinary exception, so the task's `retries` rerun the same command,
which resumes from the job's committed parts. Every other non-zero code raises `AirflowFailException`, which
fails the task at once whatever retries are left: 2 (invalid spec, or an environment a person must fix),
3 (error budget exceeded), 4 (the output path holds another job), 5 (verify found a differing row) and 1
(a bug) would fail the same way again. `deepinfer-job status OUTPUT` shows how far a job got. On success
the task returns the run summary (the CLI's `--summary-json`), so it lands in XCom as `return_value`.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shlex
import subprocess
import tempfile
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

log = logging.getLogger(__name__)

# deepinfer-job's exit codes. Copied, not imported: the worker's Python need not have deepinfer installed.
EXIT_OK = 0
EXIT_BUG = 1
EXIT_USAGE = 2  # invalid spec or usage, or an environment a person must fix
EXIT_ERROR_BUDGET = 3
EXIT_OTHER_JOB = 4  # the output path holds another job's output
EXIT_VERIFY_MISMATCH = 5
EXIT_RETRYABLE = 75  # EX_TEMPFAIL: run the same command again, it resumes

EXIT_MEANINGS: dict[int, str] = {
    EXIT_BUG: "a bug in deepinfer (rerun by hand with -v for the traceback and report it)",
    EXIT_USAGE: "invalid spec or usage, or an environment a person must fix",
    EXIT_ERROR_BUDGET: "error budget exceeded (too many rows quarantined)",
    EXIT_OTHER_JOB: "the output path holds another job",
    EXIT_VERIFY_MISMATCH: "verify found a row that differs",
    EXIT_RETRYABLE: "transient failure (storage, engine or infrastructure); a rerun resumes",
}

JOB_BIN_ENV = "DEEPINFER_JOB_BIN"
RAY_ADDRESS_ENV = "DEEPINFER_RAY_ADDRESS"
RAY_ADDRESS_VARIABLE = "deepinfer_ray_address"

DEFAULT_PARAMS: dict[str, str] = {
    "spec": "/opt/deepinfer/jobs/labeling.yaml",
    "input_path": "s3://my-bucket/reviews/{ds}/",  # empty: keep the spec's input.path
    "output_path": "s3://my-bucket/labels/{ds}/",
    "name": "review-labeling-{ds_nodash}",  # empty: keep the spec's name
}

# Lines of the CLI's output kept for the exception message, so the failure reason shows in the task's
# summary and in alerts without opening the full log.
TAIL_LINES = 20


def build_command(job_bin: str, params: Mapping[str, str], summary_json: str,
                  ray_address: str | None) -> list[str]:
    """The `deepinfer-job submit` argv for one run. A retry builds the same argv, which is what resumes."""
    argv = [job_bin, "submit", params["spec"]]
    for key, field in (("input_path", "input.path"), ("output_path", "output.path"), ("name", "name")):
        if params.get(key):
            argv += ["--set", f"{field}={params[key]}"]
    argv += ["--summary-json", summary_json]
    if ray_address:
        argv += ["--address", ray_address]
    return argv


def is_retryable(returncode: int) -> bool:
    """Only 75 is worth an automatic retry. Anything else needs a person: the documented codes would fail
    the same way again, and so would a CLI killed by a signal (the OOM killer, say) or an unknown code."""
    return returncode == EXIT_RETRYABLE


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"killed by signal {-returncode}"
    return EXIT_MEANINGS.get(returncode, "an exit code outside deepinfer-job's contract")


def expand(params: Mapping[str, Any], ds: str, ds_nodash: str) -> dict[str, str]:
    """Params as strings, `{ds}`/`{ds_nodash}` replaced (str.replace, not format: paths may hold braces)."""
    return {key: str(value or "").replace("{ds}", ds).replace("{ds_nodash}", ds_nodash)
            for key, value in params.items()}


def run_cli(argv: list[str], env: Mapping[str, str]) -> tuple[int, list[str]]:
    """Run the CLI, streaming its output into the task log line by line; returns (exit code, last lines)."""
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    log.info("running: %s", shlex.join(argv))  # quoted, so it can be pasted to rerun the job by hand
    # stderr joins stdout so the log keeps the CLI's own order of progress and error lines. If the task is
    # killed (timeout, SIGTERM on worker shutdown), leaving the with-block kills the child too; the job is
    # resumable, so a later run picks up its committed parts.
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                          env=dict(env), text=True, errors="replace") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            log.info("%s", line)
    return proc.returncode, list(tail)


try:
    from airflow.sdk import Param, Variable, dag, get_current_context, task

    try:  # the Task SDK's own; newer 3.x deprecate the airflow.exceptions name, older ones lack this one
        from airflow.sdk.exceptions import AirflowFailException
    except ImportError:
        from airflow.exceptions import AirflowFailException  # type: ignore[no-redef]
except ImportError:  # no Airflow 3 here: the module defines only its helpers, and no DAG
    dag = None


class DeepinferRetryableError(RuntimeError):
    """The CLI exited 75: an ordinary exception, so the task's retries apply."""


def ray_address() -> str | None:
    """The Ray cluster to attach to, only where the deployment names one (worker env first: it is the more
    specific setting; then the Airflow Variable). None: the CLI starts a local Ray."""
    address = os.environ.get(RAY_ADDRESS_ENV) or Variable.get(RAY_ADDRESS_VARIABLE, default=None)
    return address or None


def run_deepinfer_job() -> dict[str, Any]:
    """Body of the task: submit the job, map the exit code onto fail-now / retry / the summary for XCom."""
    context = get_current_context()
    # A run triggered without a logical date (allowed in Airflow 3) has no `ds`: date it by run_after.
    day = context.get("logical_date") or context["dag_run"].run_after
    params = expand({key: context["params"][key] for key in DEFAULT_PARAMS},
                    ds=day.strftime("%Y-%m-%d"), ds_nodash=day.strftime("%Y%m%d"))
    if not params["spec"] or not params["output_path"]:
        raise AirflowFailException("params 'spec' and 'output_path' must be set")
    job_bin = os.environ.get(JOB_BIN_ENV) or "deepinfer-job"
    address = ray_address()
    env = dict(os.environ)
    # The CLI falls back to $RAY_ADDRESS: drop one the worker merely inherited, so that the deployment's
    # setting above is the only way a job attaches to a cluster.
    env.pop("RAY_ADDRESS", None)
    if address:
        env["RAY_ADDRESS"] = address  # besides --address, for Ray code that reads the variable itself
    with tempfile.TemporaryDirectory(prefix="deepinfer-airflow-") as tmp:
        summary_path = os.path.join(tmp, "summary.json")
        argv = build_command(job_bin, params, summary_path, address)
        try:
            returncode, tail = run_cli(argv, env)
        except OSError as exc:  # no such executable, not executable: a deployment a person must fix
            raise AirflowFailException(f"cannot run {job_bin!r} (set {JOB_BIN_ENV}?): {exc}") from exc
        if returncode == EXIT_OK:
            try:
                with open(summary_path, encoding="utf-8") as f:
                    summary: dict[str, Any] = json.load(f)
            except (OSError, ValueError) as exc:
                # Exit 0 without a summary breaks the CLI's contract; a rerun would not explain it.
                raise AirflowFailException(f"deepinfer-job exited 0, no readable summary: {exc}") from exc
            log.info("job %s done: %s", summary.get("job"), summary.get("rows"))
            return summary
    message = f"deepinfer-job exited {returncode}: {describe_exit(returncode)}"
    if tail:
        message += "\n" + "\n".join(tail)
    if is_retryable(returncode):
        raise DeepinferRetryableError(message)
    raise AirflowFailException(message)


if dag is not None:

    @dag(
        dag_id="deepinfer_review_labeling",
        start_date=datetime(2026, 1, 1),
        schedule="@daily",
        catchup=False,
        # One job at a time: a run can hold the worker's GPUs (or the cluster) for hours; runs queue.
        max_active_runs=1,
        params={key: Param(value, type="string") for key, value in DEFAULT_PARAMS.items()},
        tags=["deepinfer"],
        doc_md=__doc__,
    )
    def deepinfer_review_labeling() -> None:
        # The retries only ever see exit 75: every other failure raises AirflowFailException. The delay
        # gives storage or the cluster time to come back; each retry resumes from committed parts.
        @task(task_id="submit_job", retries=3, retry_delay=timedelta(minutes=10))
        def submit_job() -> dict[str, Any]:
            return run_deepinfer_job()

        submit_job()

    labeling_dag = deepinfer_review_labeling()
