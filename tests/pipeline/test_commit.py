"""The commit protocol (pipeline/commit.py, storage.py, lease.py) on local disk and on a real S3 endpoint.

S3 is moto's server on 127.0.0.1 (free port), spoken to over HTTP by s3fs exactly as AWS would be.
Process-level kills use the synthetic job of tests/commit_harness.py and the DEEPINFER_TEST_KILL_AT hook.
"""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest
from deepinfer.pipeline.errors import FingerprintMismatch, RetryableStorageError
from deepinfer.pipeline.output import storage
from deepinfer.pipeline.output.commit import OutputStore
from deepinfer.pipeline.output.status import job_status, render_status

from tests.support import commit_harness as h
from tests.support.moto_s3 import S3_ENV, moto_s3


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as server:
        yield server


def _target(backend, request, tmp_path):
    if backend == "local":
        return str(tmp_path / "out"), None, {}
    server = request.getfixturevalue("s3")
    monkeypatch = request.getfixturevalue("monkeypatch")
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    return server.url(), server.storage_options, server.env


@pytest.fixture(params=["local", "s3"])
def target(request, tmp_path):
    """(url, storage_options, subprocess env) of a fresh, empty output on each backend."""
    return _target(request.param, request, tmp_path)


def _ids(url, so):
    store = OutputStore(url, so)
    return store.read_committed().column("id").to_pylist() + store.read_committed("errors").column(
        "id"
    ).to_pylist()


def _reference(tmp_path, seed=0, fmt="parquet"):
    url = str(tmp_path / f"ref-{seed}-{fmt}")
    h.run(url, seed=seed, fmt=fmt)
    return h.snapshot(url)


# ---- storage primitives --------------------------------------------------------------------------------


def test_put_if_absent_creates_once_and_keeps_the_first_bytes(target):
    url, so, _ = target
    fs, root = storage.open_fs(url, so)
    path = storage.join(root, "m", "k.json")
    assert storage.put_if_absent(fs, path, b"first") is True
    assert storage.put_if_absent(fs, path, b"second") is False
    assert storage.read_bytes(fs, path) == b"first"
    assert storage.list_names(fs, storage.join(root, "m")) == ["k.json"]  # no temp file left behind


def test_put_if_absent_concurrent_exactly_one_winner(target):
    url, so, _ = target
    fs, root = storage.open_fs(url, so)
    threads_per_key, keys = 6, 8
    results: dict[int, list[tuple[int, bool]]] = {k: [] for k in range(keys)}
    barrier = threading.Barrier(threads_per_key)

    def racer(t: int) -> None:
        for k in range(keys):
            barrier.wait()
            won = storage.put_if_absent(fs, storage.join(root, f"race-{k}"), f"writer-{t}".encode())
            results[k].append((t, won))

    threads = [threading.Thread(target=racer, args=(t,)) for t in range(threads_per_key)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(keys):
        winners = [t for t, won in results[k] if won]
        assert len(winners) == 1, f"key {k}: winners {winners}"
        assert storage.read_bytes(fs, storage.join(root, f"race-{k}")) == f"writer-{winners[0]}".encode()


@pytest.mark.parametrize(
    "exc, retryable",
    [
        (ConnectionRefusedError(111, "refused"), True),
        (TimeoutError("timed out"), True),
        (OSError(16, "SlowDown"), True),  # s3fs maps 503 SlowDown to EBUSY
        (OSError(28, "No space left on device"), True),
        (FileNotFoundError(2, "missing"), False),
        (PermissionError(13, "denied"), False),
        (ValueError("bad"), False),
    ],
)
def test_is_retryable_classifies_infra_failures(exc, retryable):
    assert storage.is_retryable(exc) is retryable
    wrapped = RuntimeError("wrapper")
    wrapped.__cause__ = exc
    assert storage.is_retryable(wrapped) is retryable


def test_unreachable_s3_raises_retryable_storage_error(monkeypatch):
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    from tests.support.moto_s3 import free_port

    options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{free_port()}"},
               "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
    with pytest.raises(RetryableStorageError):
        OutputStore("s3://nobucket/out", options).begin(h.job()[1])


@pytest.mark.parametrize("url", ["gs://bucket/x", "memory://x", ""])
def test_unsupported_output_protocols_are_refused(url):
    with pytest.raises(ValueError, match="output.path|not supported"):
        storage.open_fs(url)


# ---- commit protocol -----------------------------------------------------------------------------------


def test_commit_reads_back_every_row_once_and_rerun_is_a_noop(target):
    url, so, _ = target
    first = h.run(url, so)
    assert first == {"complete_before": False, "committed": 11, "orphans_removed": 0}
    assert sorted(_ids(url, so)) == sorted(h.all_ids())
    before = h.snapshot(url, so)
    assert h.run(url, so) == {"complete_before": True, "committed": 0, "orphans_removed": 0}
    assert h.snapshot(url, so) == before and h.leases(url, so) == []  # nothing written, not even a lease
    markers = OutputStore(url, so).read_markers()
    totals = (sum(m["rows"] for m in markers.values()), sum(m["error_rows"] for m in markers.values()))
    assert totals == (43, 6)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_same_rows_give_byte_identical_outputs_on_every_backend(target, tmp_path, fmt):
    url, so, _ = target
    h.run(url, so, fmt=fmt, order_seed=3)  # commit order must not matter
    assert h.snapshot(url, so) == _reference(tmp_path, fmt=fmt)


def test_second_commit_of_a_part_returns_false_and_touches_nothing(target):
    url, so, _ = target
    parts, record = h.job()
    with OutputStore(url, so) as store:
        store.begin(record)
        rows, errors = h.part_tables(parts[0], 0)
        assert store.commit_part(parts[0].part_id, rows, errors, "parquet") is True
        before = h.snapshot(url, so)
        other = rows.set_column(1, "text", pa.array(["x"] * rows.num_rows))
        assert store.commit_part(parts[0].part_id, other, errors, "parquet") is False
        assert h.snapshot(url, so) == before


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda p, r, e: (p, r.slice(1), e, "parquet"), "every row must end in exactly one"),
        (lambda p, r, e: ("99999-0000000000", r, e, "parquet"), "not in this job's part plan"),
        (lambda p, r, e: (p, r, e, "jsonl"), "not the job's format"),
        (lambda p, r, e: (p, r, e, "csv"), "output.format"),
    ],
)
def test_commit_part_rejects_inconsistent_calls(tmp_path, mutate, message):
    parts, record = h.job()
    with OutputStore(str(tmp_path / "o")) as store:
        store.begin(record)
        rows, errors = h.part_tables(parts[0], 0)
        with pytest.raises(ValueError, match=message):
            store.commit_part(*mutate(parts[0].part_id, rows, errors))


def test_write_success_refuses_while_parts_are_missing(tmp_path):
    with OutputStore(str(tmp_path / "o")) as store:
        store.begin(h.job()[1])
        with pytest.raises(RuntimeError, match="uncommitted"):
            store.write_success({})


def test_other_fingerprint_is_refused_with_differences_then_restart_replaces(target, tmp_path):
    url, so, _ = target
    h.run(url, so, seed=0)
    with pytest.raises(FingerprintMismatch, match=r"sampling: seed: 0 -> 1") as info:
        OutputStore(url, so).begin(h.job(seed=1)[1])
    assert info.value.exit_code == 4
    assert h.run(url, so, seed=1, restart=True)["committed"] == 11
    assert h.snapshot(url, so) == _reference(tmp_path, seed=1)


def test_racing_threads_commit_every_part_exactly_once(tmp_path):
    url, so = str(tmp_path / "out"), None
    results: list[dict] = []
    threads = [threading.Thread(target=lambda s=s: results.append(h.run(url, so, order_seed=s)))
               for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r["committed"] for r in results) == 11
    assert sorted(_ids(url, so)) == sorted(h.all_ids())
    assert h.snapshot(url, so) == _reference(tmp_path) and h.leases(url, so) == []


def test_racing_processes_commit_every_part_exactly_once(target, tmp_path):
    url, so, env = target
    args = {"url": url, "storage_options": so}
    children = [h.start_child({**args, "order_seed": s}, env=env) for s in range(3)]
    results = [c.wait() for c in children]
    assert [code for code, _ in results] == [0, 0, 0], results
    assert sum(r["committed"] for _, r in results) == 11
    assert h.snapshot(url, so) == _reference(tmp_path)


# ---- kills ---------------------------------------------------------------------------------------------

KILLS = [
    ("local", ["after_part_data_written:2"]),  # leaves orphans
    ("local", ["after_part_data_written:2", "during_orphan_cleanup:1"]),  # the cleanup itself is killed
    ("local", ["before_part_data_written:3", "after_part_committed:2", "before_success:1"]),
    ("s3", ["after_part_data_written:2", "during_orphan_cleanup:1"]),
    ("s3", ["after_part_data_written:1", "after_part_committed:2", "before_success:1"]),
]


@pytest.mark.parametrize("backend, kills", KILLS, ids=[f"{b}-{'+'.join(k)}" for b, k in KILLS])
def test_killed_runs_resume_to_byte_identical_output(backend, kills, request, tmp_path):
    url, so, env = _target(backend, request, tmp_path)
    args = {"url": url, "storage_options": so}
    for kill in kills:
        assert h.run_child(args, kill_at=kill, env=env) == (-9, None), kill
    code, result = h.run_child(args, env=env)
    assert code == 0 and result["complete_before"] is False
    assert sorted(_ids(url, so)) == sorted(h.all_ids())  # every row exactly once
    assert h.snapshot(url, so) == _reference(tmp_path)  # no orphan, no partial, same bytes
    assert h.leases(url, so) == []


def test_killed_restart_keeps_refusing_until_restarted_again(tmp_path):
    url = str(tmp_path / "out")
    h.run(url, seed=0)
    assert h.run_child({"url": url, "seed": 1, "restart": True}, kill_at="during_restart:3") == (-9, None)
    code, message = h.run_child({"url": url, "seed": 1})
    assert code == 4 and "sampling: seed: 0 -> 1" in message
    assert h.run_child({"url": url, "seed": 1, "restart": True})[0] == 0
    assert h.snapshot(url) == _reference(tmp_path, seed=1)


def test_cleanup_leaves_orphans_alone_while_another_run_is_live(tmp_path):
    url = str(tmp_path / "o")
    parts, record = h.job()
    orphan = f"parts/{parts[1].part_id}-0000000000000000.parquet"
    fs, root = storage.open_fs(url)
    with OutputStore(url) as live:
        live.begin(record)
        storage.write_atomic(fs, f"{root}/{orphan}", b"left by a killed run")
        with OutputStore(url) as other:
            assert other.begin(record).orphans_removed == 0  # `live` holds a lease: hands off
        assert orphan in h.snapshot(url)
    with OutputStore(url) as alone:
        assert alone.begin(record).orphans_removed == 1
    assert orphan not in h.snapshot(url)


def test_status_reports_progress_from_markers(target):
    url, so, _ = target
    assert job_status(url, so)["state"] == "empty"
    parts, record = h.job()
    with OutputStore(url, so) as store:
        store.begin(record)
        for part in parts[:4]:
            store.commit_part(part.part_id, *h.part_tables(part, 0), "parquet")
        st = job_status(url, so)
        assert st["live_runs"] == 1
    assert (st["state"], st["total_parts"], st["committed_parts"]) == ("running", 11, 4)
    assert job_status(url, so)["state"] == "interrupted"  # the lease is released: no run is live
    assert (st["total_rows"], st["committed_rows"] + st["error_rows"]) == (49, 20)
    assert st["error_codes"] == {"INVALID_JSON": st["error_rows"]}
    h.run(url, so)
    st = job_status(url, so)
    assert st["complete"] and (st["committed_rows"], st["error_rows"], st["live_runs"]) == (43, 6, 0)
    assert st["summary"]["summary"] == {"job": "synthetic", "seed": 0}
    assert "11/11 committed" in render_status(st) and "INVALID_JSON=6" in render_status(st)
