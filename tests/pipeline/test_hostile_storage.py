"""Exit codes tell the truth about storage and input failures (defects 6 and 7).

Errors a person must fix exit 2 with a message saying what to fix (access denied, bad credentials, a
missing bucket, a read-only or wrong-kind path, a corrupt or non-Parquet input file named with its path,
a refused spec inside a Ray actor, MemoryError); only transient ones exit 75 (throttling, 5xx, timeouts,
connection resets, lost workers). Real failures come from a moto S3 server and the local disk; the S3
error codes moto cannot provoke are the ClientErrors botocore raises, translated exactly as s3fs does.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deepinfer.pipeline.errors import InputError, OutputPathError, SpecError, classify_exception
from deepinfer.pipeline.output.commit import OutputStore
from deepinfer.pipeline.stages.read import list_input, read_rows

from tests.support import commit_harness as h
from tests.support.moto_s3 import S3_ENV, moto_s3


@pytest.fixture(scope="module")
def s3():
    saved = {k: os.environ.get(k) for k in S3_ENV}
    os.environ.update(S3_ENV)
    try:
        with moto_s3() as server:
            yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _client_error(code: str, status: int, operation: str = "PutObject") -> BaseException:
    """The exception s3fs raises for an S3 error response (botocore ClientError, translated)."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    error = ClientError({"Error": {"Code": code, "Message": f"{code} (test)"},
                         "ResponseMetadata": {"HTTPStatusCode": status}}, operation)
    return translate_boto_error(error)


def _code(exc: BaseException) -> int:
    return int(classify_exception(exc)[0])


@pytest.mark.parametrize("code, status, expected, words", [
    ("AccessDenied", 403, 2, "access denied: check the credentials"),
    ("InvalidAccessKeyId", 403, 2, "access key id is not valid"),
    ("SignatureDoesNotMatch", 403, 2, "secret key does not match"),
    ("ExpiredToken", 400, 2, "expired"),
    ("NoSuchBucket", 404, 2, "bucket does not exist"),
    ("SlowDown", 503, 75, "retryable"),
    ("InternalError", 500, 75, "retryable"),
    ("ServiceUnavailable", 503, 75, "retryable"),
    ("RequestTimeout", 400, 75, "retryable"),
])
def test_s3_error_responses_map_to_2_or_75(code, status, expected, words) -> None:
    exc = _client_error(code, status)
    got, message = classify_exception(exc)
    assert (int(got), code) == (expected, code)
    assert words in message.lower(), message


@pytest.mark.parametrize("exc, expected", [
    (PermissionError(errno.EACCES, "Permission denied", "/data/out"), 2),
    (OSError(errno.EROFS, "Read-only file system", "/mnt/ro/out"), 2),
    (NotADirectoryError(errno.ENOTDIR, "Not a directory", "/data/file/out"), 2),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/nope"), 2),
    (MemoryError(), 2),
    (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), 75),
    (TimeoutError("read timed out"), 75),
    (OSError(errno.EIO, "Input/output error"), 75),
    (KeyError("bug"), 1),
])
def test_local_and_generic_failures_map_to_the_contract(exc: BaseException, expected: int) -> None:
    assert _code(exc) == expected


def test_missing_bucket_on_a_real_s3_server_exits_2(s3) -> None:
    store = OutputStore("s3://no-such-bucket-deepinfer/out", s3.storage_options)
    with pytest.raises(Exception) as info:
        store.begin(h.job()[1])
    assert _code(info.value) == 2, repr(info.value)


def test_unreachable_endpoint_exits_75_and_missing_credentials_exit_2(monkeypatch) -> None:
    options = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}, "config_kwargs": {
        "connect_timeout": 0.2, "retries": {"max_attempts": 1}}, "skip_instance_cache": True}
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(Exception) as info:
        OutputStore("s3://deepinfer/out", options).begin(h.job()[1])
    code, message = classify_exception(info.value)
    assert int(code) == 2 and "credentials" in message, repr(info.value)
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(Exception) as info:
        OutputStore("s3://deepinfer/out", options).begin(h.job()[1])
    assert _code(info.value) == 75, repr(info.value)


def test_output_path_that_is_a_regular_file_exits_2(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.write_text("not a directory")
    with pytest.raises(OutputPathError, match="is a file, not a directory") as info:
        OutputStore(str(target)).begin(h.job()[1])
    assert _code(info.value) == 2


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs Linux sysfs")
def test_an_unwritable_local_path_exits_2() -> None:
    """sysfs refuses new directories (EPERM, or EROFS where it is mounted read-only), even to root."""
    with pytest.raises(OSError) as info:
        OutputStore("/sys/deepinfer-test-output").begin(h.job()[1])
    assert info.value.errno in (errno.EPERM, errno.EROFS, errno.EACCES)
    assert _code(info.value) == 2


def test_refused_spec_inside_a_ray_actor_exits_2() -> None:
    """An actor whose constructor raised SpecError reaches the driver as ActorDiedError text only."""
    ray_exceptions = pytest.importorskip("ray.exceptions")
    try:
        raise SpecError(["model: the engine refused its configuration: pickle checkpoints are refused"])
    except SpecError as inner:
        task_error = ray_exceptions.RayTaskError("EngineActor.__init__", "Traceback ...\n"
                                                 "deepinfer.pipeline.errors.SpecError: invalid job spec:\n"
                                                 "  model: pickle checkpoints are refused", inner)
    died = ray_exceptions.ActorDiedError(cause=task_error)
    code, message = classify_exception(died)
    assert int(code) == 2 and "pickle checkpoints are refused" in message
    import pickle  # a SpecError crossing a process boundary keeps its problems

    again = pickle.loads(pickle.dumps(SpecError(["a.b: bad"])))
    assert again.problems == ["a.b: bad"]


# The text Ray Data 2.60 gives the driver for an exception raised in a UDF: the user exception survives
# only in the traceback text (its UserCodeException wrapper is pickled without __cause__).
_UDF_TEXT = ("ray::MapWorker(MapBatches(NodeEngineActor)).submit()\nTraceback (most recent call last):\n"
             '  File "pipeline/stages/generate.py", line 212, in generate_part\n{error}\n\n'
             "The above exception was the direct cause of the following exception:\n\n"
             "ray.exceptions.UserCodeException: UDF failed to process a data block.")


@pytest.mark.parametrize("error, expected, words", [
    ("deepinfer.pipeline.errors.NumericsMismatch: engine a@b: the job's committed parts were computed "
     "with [x]", 4, "committed parts were computed with [x]"),
    ("deepinfer.pipeline.errors.RetryableError: part 00001: this writer's lease went stale", 75,
     "retryable failure: part 00001: this writer's lease went stale"),
    ("OSError: [Errno 5] boom\n\nThe above exception was the direct cause of the following exception:\n\n"
     "deepinfer.pipeline.errors.RetryableStorageError: writing s3://b/out timed out", 75, "timed out"),
    ("deepinfer.pipeline.errors.FingerprintMismatch: output s3://b/out holds another job (different "
     "fingerprint):\n  - sampling.seed: 1 -> 2", 4, "holds another job: output s3://b/out"),
    ("deepinfer.pipeline.errors.SpecError: invalid job spec:\n  model: pickle checkpoints are refused", 2,
     "pickle checkpoints are refused"),
    ("ValueError: not one of ours", 1, "unexpected error"),
])
def test_a_job_error_raised_inside_a_ray_data_udf_keeps_its_exit_code(error, expected, words) -> None:
    ray_exceptions = pytest.importorskip("ray.exceptions")
    wrapper = ray_exceptions.UserCodeException("UDF failed to process a data block.")
    task_error = ray_exceptions.RayTaskError("MapWorker.submit", _UDF_TEXT.format(error=error), wrapper)
    code, message = classify_exception(task_error.as_instanceof_cause())
    assert (int(code), words in message) == (expected, True), message


@pytest.mark.parametrize("content, what", [
    (b"", "empty"), (b"PAR1", "truncated"), (b"this is not parquet at all", "not parquet"),
])
def test_bad_parquet_files_exit_2_naming_the_file(tmp_path: Path, content: bytes, what: str) -> None:
    good = tmp_path / "in" / "a.parquet"
    good.parent.mkdir()
    pq.write_table(pa.table({"id": [1, 2]}), good)
    bad = tmp_path / "in" / "b.parquet"
    bad.write_bytes(content)
    with pytest.raises(InputError) as info:
        list_input(str(tmp_path / "in"), "parquet")
    assert str(bad) in str(info.value) and "on_bad_file" in str(info.value), what
    assert _code(info.value) == 2
    listing = list_input(str(tmp_path / "in"), "parquet", on_bad_file="quarantine")
    assert [(f.relpath, f.num_rows, f.bad is not None) for f in listing] == [
        ("a.parquet", 2, False), ("b.parquet", 1, True)]


def test_corrupt_parquet_page_exits_2_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": [f"row {i} " * 50 for i in range(200)]}), path, compression="snappy")
    data = bytearray(path.read_bytes())
    for i in range(200, 2000):  # scribble over the first data page; the footer stays intact
        data[i] = 0xFF
    path.write_bytes(bytes(data))
    assert list_input(str(path), "parquet")[0].num_rows == 200  # the footer still reads
    with pytest.raises(InputError) as info:
        read_rows(str(path), "parquet", 0, 200)
    assert str(path) in str(info.value)


def test_glob_reads_only_the_formats_files(tmp_path: Path) -> None:
    for name in ("a.jsonl", "b.parquet", "c.csv", "_hidden.jsonl", ".dot.jsonl"):
        (tmp_path / name).write_text('{"id": 1}\n')
    listing = list_input(str(tmp_path / "*"), "jsonl")
    assert [f.relpath for f in listing] == ["a.jsonl"]
