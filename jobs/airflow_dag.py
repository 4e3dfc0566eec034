"""Example Airflow DAG: one deepinfer job per day, its paths templated with --set.

Copy this file into your DAGs folder. It imports without Airflow installed (the DAG is only defined when
Airflow is importable), so the project never depends on Airflow.

Exit codes drive retries: 75 (retryable: storage, engine, infrastructure) is worth a retry — the job resumes
from its committed parts — while 2 (invalid spec), 3 (error budget exceeded) and 4 (output holds another
job) need a person; `deepinfer-job status` shows how far a job got.
"""

from __future__ import annotations

from datetime import datetime, timedelta

SPEC = "/opt/deepinfer/jobs/labeling.yaml"
COMMAND = (
    f"deepinfer-job submit {SPEC}"
    " --set input.path=s3://my-bucket/reviews/{{ ds }}/"
    " --set output.path=s3://my-bucket/labels/{{ ds }}/"
    " --set name=review-labeling-{{ ds_nodash }}"
    " --summary-json /tmp/deepinfer-summary-{{ ds_nodash }}.json"
)

try:
    from airflow import DAG
    from airflow.operators.bash import BashOperator
except ImportError:  # Airflow is not a deepinfer dependency: without it this file only defines COMMAND
    DAG = None

if DAG is not None:
    with DAG(
        dag_id="deepinfer_review_labeling",
        start_date=datetime(2026, 1, 1),
        schedule="@daily",
        catchup=False,
        default_args={"retries": 3, "retry_delay": timedelta(minutes=10)},
        tags=["deepinfer"],
    ) as dag:
        validate = BashOperator(task_id="validate_spec",
                                bash_command=f"deepinfer-job validate {SPEC}")
        label = BashOperator(
            task_id="label_reviews",
            bash_command=COMMAND,
            env={"RAY_ADDRESS": "auto"},   # attach to the Ray cluster running on the worker's node
            append_env=True,
        )
        validate >> label
