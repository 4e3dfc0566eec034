"""A failure inside a Ray worker keeps its exit code (pipeline/worker_errors.py, errors._flattened_verdict).

Ray Data hands the driver a UDF's exception as a UserCodeException without the original object, and an
actor whose constructor raised as traceback text: a transient storage error in a worker must still exit
75, a denied bucket or an out-of-memory 2, deepinfer's own errors their codes, and a bug 1. Checked in
process (the wrapper's verdicts) and through real Ray Data tasks and actors on the session's local Ray.
"""

from __future__ import annotations

import errno

import pyarrow as pa
import pytest
from deepinfer.pipeline.errors import (
    MustFix,
    NumericsMismatch,
    RetryableError,
    SpecError,
    classify_exception,
)
from deepinfer.pipeline.worker_errors import in_worker

# (what the worker raises, the exit code the driver must report, words its message must hold)
CASES = [
    (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), 75, "ConnectionResetError"),
    (TimeoutError("read timed out"), 75, "read timed out"),
    (PermissionError(errno.EACCES, "Permission denied", "s3://bucket/in/a.jsonl"), 2, "permission denied"),
    (MemoryError(), 2, "out of memory"),
    (NumericsMismatch("engine e@n: the job's committed parts were computed with [x]"), 4,
     "computed with [x]"),
    (SpecError(["model: the engine refused its configuration: no GPU"]), 2, "no GPU"),
    (KeyError("a bug"), 1, "unexpected error"),
]
IDS = [type(c[0]).__name__ for c in CASES]


@pytest.mark.parametrize("exc, code, words", CASES, ids=IDS)
def test_a_raw_failure_is_reraised_as_the_deepinfer_error_of_its_verdict(exc, code, words) -> None:
    def work() -> None:
        raise exc

    with pytest.raises(Exception) as info:
        in_worker(work)()
    expected = {75: RetryableError, 2: (MustFix, SpecError), 4: NumericsMismatch, 1: KeyError}[code]
    assert isinstance(info.value, expected)
    got, message = classify_exception(info.value)
    assert (int(got), words in message) == (code, True), message


@pytest.mark.parametrize("exc, code, words", CASES, ids=IDS)
def test_a_ray_data_task_failure_reaches_the_driver_with_its_exit_code(shared_ray, exc, code, words) -> None:
    shared_ray.start()
    import ray.data

    @in_worker
    def udf(batch: pa.Table) -> pa.Table:
        raise exc

    ds = ray.data.from_arrow(pa.table({"x": [1]})).map_batches(udf, batch_format="pyarrow")
    with pytest.raises(Exception) as info:
        ds.take_all()
    got, message = classify_exception(info.value)
    assert (int(got), words in message) == (code, True), message


def test_an_actor_whose_constructor_failed_reaches_the_driver_with_its_exit_code(shared_ray) -> None:
    shared_ray.start()
    import ray.data

    class Actor:
        @in_worker
        def __init__(self) -> None:
            raise PermissionError(errno.EACCES, "Permission denied", "s3://bucket/model")

        def __call__(self, batch: pa.Table) -> pa.Table:
            return batch

    ds = ray.data.from_arrow(pa.table({"x": [1]})).map_batches(
        Actor, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=1))
    with pytest.raises(Exception) as info:
        ds.take_all()
    got, message = classify_exception(info.value)
    assert (int(got), "permission denied" in message) == (2, True), message
