#!/usr/bin/env bash
# Create (or reuse) a virtualenv holding Apache Airflow 3, for tests/pipeline/test_airflow_dag.py.
#
#   bash .ci/airflow_venv.sh DIR      # prints DIR/bin/python as the last line of stdout
#   DEEPINFER_AIRFLOW_PYTHON=$(bash .ci/airflow_venv.sh /tmp/airflow-venv) python3 -m pytest ...
#
# Airflow lives in its own virtualenv because its pins (sqlalchemy, pydantic, fastapi, ...) conflict with
# the project's; the project never imports Airflow. Everything pip prints goes to stderr so that stdout is
# only the python path.
#
# Settings (environment):
#   AIRFLOW_VERSION       Airflow release to install (default below; newest 3.x on PyPI when written).
#   AIRFLOW_BASE_PYTHON   interpreter the venv is made from (default: python3.11, else python3).
#   AIRFLOW_CONSTRAINTS   optional pip constraints file (Airflow's published constraints-X.Y.txt); not
#                         needed for the test, and upstream's file is on GitHub, which CI cannot reach.
set -euo pipefail

die() { echo "airflow_venv.sh: error: $*" >&2; exit 1; }

[[ $# -eq 1 && -n "$1" ]] || die "usage: bash .ci/airflow_venv.sh DIR"
DIR=$1
AIRFLOW_VERSION=${AIRFLOW_VERSION:-3.3.2}

# What "works" means: this venv imports the SDK the DAG uses at the asked-for version. Checked before
# reuse and again after install, so a half-finished earlier run is never taken for a good one.
venv_works() {
    [[ -x "$DIR/bin/python" ]] || return 1
    "$DIR/bin/python" - "$AIRFLOW_VERSION" <<'PY' >/dev/null 2>&1
import sys
import airflow
from airflow.exceptions import AirflowFailException  # noqa: F401  (the DAG's non-retryable error)
from airflow.sdk import dag, task  # noqa: F401
sys.exit(0 if airflow.__version__ == sys.argv[1] else 1)
PY
}

if venv_works; then
    echo "airflow_venv.sh: reusing $DIR (apache-airflow $AIRFLOW_VERSION)" >&2
    echo "$DIR/bin/python"
    exit 0
fi

if [[ -n "${AIRFLOW_BASE_PYTHON:-}" ]]; then
    BASE=$AIRFLOW_BASE_PYTHON
elif command -v python3.11 >/dev/null 2>&1; then
    BASE=python3.11
else
    BASE=python3
fi
command -v "$BASE" >/dev/null 2>&1 || die "base interpreter '$BASE' not found (set AIRFLOW_BASE_PYTHON)"
"$BASE" -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] <= (3, 13) else 1)' \
    || die "$BASE is $("$BASE" -V 2>&1); Airflow 3 needs Python 3.10-3.13"

# A DIR that exists but does not work is rebuilt only if it is a virtualenv (or empty): never delete a
# folder this script did not make.
if [[ -e "$DIR" ]]; then
    if [[ -f "$DIR/pyvenv.cfg" ]] || [[ -d "$DIR" && -z "$(ls -A "$DIR")" ]]; then
        echo "airflow_venv.sh: $DIR exists but has no working Airflow $AIRFLOW_VERSION; rebuilding it" >&2
        rm -rf -- "$DIR"
    else
        die "$DIR exists and is not a virtualenv; refusing to touch it"
    fi
fi

start=$(date +%s)
echo "airflow_venv.sh: creating $DIR from $("$BASE" -V 2>&1), installing apache-airflow==$AIRFLOW_VERSION" >&2
"$BASE" -m venv "$DIR" >&2
"$DIR/bin/python" -m pip install -q --upgrade pip >&2
constraint_args=()
if [[ -n "${AIRFLOW_CONSTRAINTS:-}" ]]; then
    [[ -f "$AIRFLOW_CONSTRAINTS" ]] || die "AIRFLOW_CONSTRAINTS=$AIRFLOW_CONSTRAINTS is not a file"
    constraint_args=(--constraint "$AIRFLOW_CONSTRAINTS")
fi
"$DIR/bin/python" -m pip install -q "apache-airflow==$AIRFLOW_VERSION" "${constraint_args[@]}" >&2 \
    || die "pip install apache-airflow==$AIRFLOW_VERSION into $DIR failed"

venv_works || die "apache-airflow $AIRFLOW_VERSION installed into $DIR but 'from airflow.sdk import dag' fails"
echo "airflow_venv.sh: installed apache-airflow $AIRFLOW_VERSION into $DIR in $(( $(date +%s) - start ))s" >&2
echo "$DIR/bin/python"
