"""jobs/airflow_dag.py under real Apache Airflow 3: only exit 75 is retried, everything else fails at once.

Airflow's pins conflict with the project's, so Airflow lives in its own virtualenv: `bash .ci/airflow_venv.sh
DIR` makes one and prints its python; point DEEPINFER_AIRFLOW_PYTHON at it. Without it these tests skip.

Everything Airflow runs in one subprocess (a driver script written below) that calls `dag.test()` once per
case, because each Airflow start costs seconds; the DB is a throwaway sqlite file in a temporary
AIRFLOW_HOME. `deepinfer-job` is a stand-in script that records how it was called and exits with the
case's codes. The deployed DAG is run as it is, except that the test zeroes the task's retry delay
(`dag.test()` would otherwise sit out the ten minutes) and adds callbacks that record each try's outcome.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

DAG_FILE = Path(__file__).resolve().parents[2] / "jobs" / "airflow_dag.py"
DAG_ID = "deepinfer_review_labeling"
TASK_ID = "submit_job"
RETRIES = 3  # the DAG's own setting: a try that exits 75 is retried this many times
DAG_TIMEOUT_S = 240  # a hang (e.g. dag.test() waiting out a retry delay) must fail, not stall CI

SUMMARY = {
    "job": "review-labeling-test", "output": "/data/out", "status": "succeeded", "exit_code": 0,
    "rows": {"total": 3, "ok": 3, "errored": 0, "this_run": 3, "resumed": 0},
}

# name -> codes: the stand-in's exit codes, call by call (the last repeats); state: the task's final state;
# outcomes: what Airflow made of each try (the callback it ran, and the state it gave the try); env: the
# worker's environment for the run; ray_address: the cluster the CLI must be pointed at (default: none).
CASES: dict[str, dict[str, Any]] = {
    "exit0_done": dict(codes=[0], state="success", outcomes=["success"]),
    "exit1_bug": dict(codes=[1], state="failed", outcomes=["failed"]),
    "exit2_invalid_spec": dict(codes=[2], state="failed", outcomes=["failed"]),
    "exit3_error_budget": dict(codes=[3], state="failed", outcomes=["failed"]),
    "exit4_other_job": dict(codes=[4], state="failed", outcomes=["failed"]),
    "exit5_verify_mismatch": dict(codes=[5], state="failed", outcomes=["failed"]),
    # Every try exits 75: up_for_retry after each try while retries remain, failed once they are spent.
    "exit75_transient": dict(codes=[75], state="failed", outcomes=["up_for_retry"] * RETRIES + ["failed"]),
    # The usual transient failure: the rerun of the same command resumes and finishes.
    "exit75_then_done": dict(codes=[75, 0], state="success", outcomes=["up_for_retry", "success"]),
    # Deployment mistakes a retry cannot fix: exit 0 with no summary, no executable at DEEPINFER_JOB_BIN.
    "exit0_no_summary": dict(codes=[0], state="failed", outcomes=["failed"], no_summary=True,
                             error="no readable summary"),
    "missing_executable": dict(codes=[], state="failed", outcomes=["failed"], error="cannot run"),
    # Ray is attached only where the deployment names a cluster (a Variable via its AIRFLOW_VAR_ env form).
    "ray_from_variable": dict(codes=[0], state="success", outcomes=["success"],
                              env={"AIRFLOW_VAR_DEEPINFER_RAY_ADDRESS": "ray://head.example:10001"},
                              ray_address="ray://head.example:10001"),
    # The worker's DEEPINFER_RAY_ADDRESS is the more specific setting: it wins over the Variable.
    "ray_from_worker_env": dict(codes=[0], state="success", outcomes=["success"],
                                env={"AIRFLOW_VAR_DEEPINFER_RAY_ADDRESS": "ray://head.example:10001",
                                     "DEEPINFER_RAY_ADDRESS": "ray://local-head:10001"},
                                ray_address="ray://local-head:10001"),
}

STUB = '''\
#!{python}
"""Stand-in for deepinfer-job: log the call, write a summary on exit 0, exit with the next code."""
import json, os, sys
CODES = {codes!r}
LOG = {log!r}
with open(LOG, "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "RAY_ADDRESS": os.environ.get("RAY_ADDRESS")}}) + "\\n")
with open(LOG) as f:
    calls = sum(1 for _ in f)
code = CODES[min(calls, len(CODES)) - 1]
if code == 0 and {write_summary!r}:
    with open(sys.argv[sys.argv.index("--summary-json") + 1], "w") as f:
        json.dump({summary!r}, f)
print("stand-in deepinfer-job: exit", code, flush=True)
sys.exit(code)
'''

# Runs inside the Airflow virtualenv: argv = dag file, cases JSON, results JSON, task id.
DRIVER = textwrap.dedent('''\
    import importlib.util, json, os, sys
    from datetime import datetime, timedelta, timezone

    import airflow
    from airflow.dag_processing.dagbag import DagBag
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    dag_file, cases_file, results_file = sys.argv[1:4]
    results = {"airflow_version": airflow.__version__}
    bag = DagBag(dag_folder=os.path.dirname(dag_file))  # examples are off: AIRFLOW__CORE__LOAD_EXAMPLES
    results["import_errors"] = {str(k): str(v) for k, v in bag.import_errors.items()}
    results["dag_ids"] = sorted(bag.dag_ids)

    spec = importlib.util.spec_from_file_location("deepinfer_airflow_dag", dag_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    dag = module.labeling_dag
    task = dag.task_dict[sys.argv[4]]
    results["task_retries"] = task.retries
    task.retry_delay = timedelta(0)
    outcomes = []

    def recorder(outcome):
        def callback(context):
            error = context.get("exception")
            state = context["ti"].state
            outcomes.append({"outcome": outcome, "try_number": context["ti"].try_number,
                             "ti_state": str(getattr(state, "value", state)),
                             "error_type": type(error).__name__ if error else None,
                             "error": str(error) if error else None})
        return callback

    # Lists: the operator only wraps a single callable into one when it is constructed.
    task.on_success_callback = [recorder("success")]
    task.on_retry_callback = [recorder("up_for_retry")]
    task.on_failure_callback = [recorder("failed")]

    base_env = dict(os.environ)
    for day, case in enumerate(json.load(open(cases_file)), start=1):
        os.environ.clear()
        os.environ.update(base_env, DEEPINFER_JOB_BIN=case["bin"], **case["env"])
        outcomes.clear()
        run = dag.test(logical_date=datetime(2026, 3, day, tzinfo=timezone.utc), run_conf=case["conf"])
        with create_session() as session:
            ti = next(t for t in run.get_task_instances(session=session) if t.task_id == task.task_id)
            xcoms = session.scalars(XComModel.get_many(run_id=run.run_id, key="return_value",
                                                       dag_ids=dag.dag_id, task_ids=task.task_id)).all()
            results[case["name"]] = {
                "state": str(ti.state.value if hasattr(ti.state, "value") else ti.state),
                "try_number": ti.try_number,
                "dag_run_state": str(getattr(run.state, "value", run.state)),
                "outcomes": list(outcomes),
                "xcom": [XComModel.deserialize_value(x) for x in xcoms],
            }
    with open(results_file, "w") as f:
        json.dump(results, f, indent=1)
''')


def airflow_python() -> str:
    python = os.environ.get("DEEPINFER_AIRFLOW_PYTHON", "")
    if not python or not Path(python).exists():
        pytest.skip("needs Apache Airflow 3 in its own virtualenv: set DEEPINFER_AIRFLOW_PYTHON to its "
                    "python (`bash .ci/airflow_venv.sh DIR` creates it and prints the path)"
                    + (f"; {python!r} does not exist" if python else ""))
    return python


def run_logged(argv: list[str], env: dict[str, str], log: Path, timeout: float) -> None:
    """Run argv with its output in `log`; on failure show the log's tail, which is where Airflow says why."""
    with open(log, "w") as out:
        try:
            proc = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{argv[1:3]} ran over {timeout}s; its log {log} ends:\n{log.read_text()[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{argv[1:3]} exited {proc.returncode}; its log {log} ends:\n{log.read_text()[-6000:]}")


@pytest.fixture(scope="module")
def airflow_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One Airflow home, DB and driver run for all cases; returns the driver's results."""
    python = airflow_python()
    root = tmp_path_factory.mktemp("airflow")
    home, dags, stubs = root / "home", root / "dags", root / "stubs"
    for d in (home, dags, stubs):
        d.mkdir()
    shutil.copy(DAG_FILE, dags / DAG_FILE.name)

    # Only what the run needs: no project PYTHONPATH (the DAG must not need deepinfer), no AIRFLOW_* or
    # deepinfer settings of the caller's; RAY_ADDRESS=auto is set on purpose, as a worker might inherit it.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AIRFLOW", "DEEPINFER_", "PYTHON")) and k != "RAY_ADDRESS"}
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "PYTHONNOUSERSITE": "1",
        "RAY_ADDRESS": "auto",
    })

    cases = []
    for name, case in CASES.items():
        stub, calls = stubs / name, stubs / f"{name}.calls.jsonl"
        if case["codes"]:  # no codes: no stand-in at all, DEEPINFER_JOB_BIN names a missing file
            stub.write_text(STUB.format(python=sys.executable, codes=case["codes"], log=str(calls),
                                        summary=SUMMARY, write_summary=not case.get("no_summary")))
            stub.chmod(0o755)
        cases.append({"name": name, "bin": str(stub), "env": case.get("env", {}),
                      "conf": {"spec": f"/specs/{name}.yaml", "output_path": f"/data/{name}/{{ds}}/"}})
    (root / "cases.json").write_text(json.dumps(cases))
    (root / "driver.py").write_text(DRIVER)

    start = time.monotonic()
    run_logged([python, "-m", "airflow", "db", "migrate"], env, root / "db_migrate.log", timeout=180)
    run_logged([python, str(root / "driver.py"), str(dags / DAG_FILE.name), str(root / "cases.json"),
                str(root / "results.json"), TASK_ID], env, root / "driver.log", timeout=DAG_TIMEOUT_S)
    results: dict[str, Any] = json.loads((root / "results.json").read_text())
    results["seconds"] = time.monotonic() - start
    calls = {name: stubs / f"{name}.calls.jsonl" for name in CASES}
    results["calls"] = {name: [json.loads(line) for line in path.read_text().splitlines()]
                        if path.exists() else [] for name, path in calls.items()}
    results["driver_log"] = str(root / "driver.log")
    return results


def test_dag_parses_under_airflow_3(airflow_runs: dict[str, Any]) -> None:
    assert airflow_runs["airflow_version"].split(".")[0] == "3", airflow_runs["airflow_version"]
    assert airflow_runs["import_errors"] == {}
    assert airflow_runs["dag_ids"] == [DAG_ID]
    assert airflow_runs["task_retries"] == RETRIES


@pytest.mark.parametrize("name", list(CASES))
def test_task_state_follows_exit_code(airflow_runs: dict[str, Any], name: str) -> None:
    case, got = CASES[name], airflow_runs[name]
    where = f"(driver log: {airflow_runs['driver_log']})"
    assert got["state"] == case["state"], where
    assert got["dag_run_state"] == case["state"], where
    outcomes = [o["outcome"] for o in got["outcomes"]]
    assert outcomes == case["outcomes"], where
    assert [o["ti_state"] for o in got["outcomes"]] == outcomes, "the state Airflow gave each try"
    assert [o["try_number"] for o in got["outcomes"]] == list(range(1, len(outcomes) + 1)), where
    assert got["try_number"] == len(outcomes), where
    calls = airflow_runs["calls"][name]
    assert len(calls) == (len(outcomes) if case["codes"] else 0), "one CLI call per try"
    if "error" in case:
        assert got["outcomes"][-1]["error_type"] == "AirflowFailException"
        assert case["error"] in got["outcomes"][-1]["error"]
        return

    for outcome, code in zip(got["outcomes"], case["codes"] + case["codes"][-1:] * len(outcomes)):
        if outcome["outcome"] == "success":
            continue
        # Exit 75 raises an ordinary exception (retries apply); every other code fails the task at once.
        expected_error = "DeepinferRetryableError" if code == 75 else "AirflowFailException"
        assert outcome["error_type"] == expected_error, outcome
        assert f"deepinfer-job exited {code}:" in outcome["error"], outcome
        assert f"stand-in deepinfer-job: exit {code}" in outcome["error"], "the CLI's last lines are kept"

    if case["state"] == "success":
        assert got["xcom"] == [SUMMARY], "the run summary is the task's return value in XCom"
    else:
        assert got["xcom"] == []

    for call in calls:
        argv = call["argv"]
        assert argv[:2] == ["submit", f"/specs/{name}.yaml"]
        day = f"2026-03-{list(CASES).index(name) + 1:02d}"
        assert f"output.path=/data/{name}/{day}/" in argv, "output path from the params, {ds} expanded"
        assert "--summary-json" in argv
        address = case.get("ray_address")
        assert call["RAY_ADDRESS"] == address, "an inherited RAY_ADDRESS=auto must not attach the job"
        if address:
            assert argv[argv.index("--address") + 1] == address
        else:
            assert "--address" not in argv
    # A retry reruns the same command (apart from its temporary summary path), which is what resumes.
    def without_summary_path(argv: list[str]) -> list[str]:
        i = argv.index("--summary-json")
        return argv[:i] + argv[i + 2:]

    assert len({json.dumps(without_summary_path(c["argv"])) for c in calls}) == 1


def test_dag_file_imports_without_airflow_or_deepinfer() -> None:
    """Only the stdlib (-S: no site-packages): the file defines its helpers and no DAG."""
    code = ("import runpy, sys; m = runpy.run_path(sys.argv[1]); "
            "assert m['dag'] is None and 'labeling_dag' not in m; "
            "assert m['is_retryable'](75) and not any(map(m['is_retryable'], (0, 1, 2, 3, 4, 5, -9)))")
    proc = subprocess.run([sys.executable, "-S", "-c", code, str(DAG_FILE)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
