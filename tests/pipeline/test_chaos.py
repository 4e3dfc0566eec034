"""Chaos: SIGKILL `deepinfer-job submit` anywhere, rerun the same command, get byte-identical output.

A 600-row JSONL job on a tiny random-weight Llama (tests/tiny_models.py), max_tokens 2, 20 parts, the
local executor. Each submit runs in its own process group; the tests kill the whole group at seeded random
moments (chosen by progress: after the run's k-th committed part plus a random fraction of one part's
time, so that kills land mid-run on any machine speed; one during start-up) and at named points through
the DEEPINFER_TEST_KILL_AT hook of commit.py. After the final rerun the output must equal an uninterrupted
run's object for object and byte for byte (only _SUCCESS, which holds the run's timings, and output.path
inside _job.json may differ), with every input id exactly once and no orphan, temp file or lease left.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest

from tests.support.cli_harness import (
    descendants,
    kill_after_commits,
    reader,
    snapshot,
    start_submit,
    submit,
    write_jsonl,
)
from tests.support.moto_s3 import S3_ENV, free_port, moto_s3

ROWS = 600
PARTS = 20
WORDS = "good bad fine great awful okay nice poor cheap solid broken lovely".split()
SPEC = """\
name: chaos
model:
  path: {model}
input:
  path: {data}
  format: jsonl
  id_column: rid
prompt:
  mode: raw
  template: "Review: {{{{ review }}}}"
sampling:
  temperature: 0.8
  max_tokens: 2
  seed: 7
output:
  path: {root}/default-out
  format: parquet
  keep_columns: [review]
runtime:
  executor: local
  rows_per_part: {rows_per_part}
  batch_size: 32
  sort_window: {rows_per_part}
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_checkpoint) -> tuple[Path, list[str]]:
    """(spec path, input ids) of the chaos job."""
    root = tmp_path_factory.mktemp("chaos")
    rng = random.Random(0)
    rows = [{"rid": f"r{i:05d}", "review": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))}
            for i in range(ROWS)]
    data = write_jsonl(root / "reviews.jsonl", rows)
    spec = root / "job.yaml"
    spec.write_text(SPEC.format(model=tiny_checkpoint("llama"), data=data, root=root,
                                rows_per_part=ROWS // PARTS))
    return spec, [r["rid"] for r in rows]


@pytest.fixture(scope="module")
def reference(job) -> tuple[str, dict[str, bytes]]:
    """An uninterrupted run's output: (url, snapshot)."""
    url = str(job[0].parent / "reference")
    code, _, err = submit(job[0], url)
    assert code == 0, err[-3000:]
    return url, snapshot(url)


def check_complete_output(job, url: str, reference: dict[str, bytes], storage_options=None,
                          same_command: bool = True) -> None:
    """Every id once, complete, and byte-identical to ``reference``. Without ``same_command`` the spec
    recorded in _job.json (the first run's) may differ in settings outside the fingerprint."""
    out = reader(url, storage_options)
    ids = out.read_committed().column("rid").to_pylist()
    assert len(ids) == len(set(ids)) == ROWS and sorted(ids) == job[1]  # every row exactly once
    assert out.is_complete()
    got = snapshot(url, storage_options)
    if not same_command:
        reference = dict(reference)
        fingerprints = [json.loads(d.pop("_job.json"))["fingerprint"] for d in (got, reference)]
        assert fingerprints[0] == fingerprints[1]
    assert sorted(got) == sorted(reference)  # no orphan, temp file or lease; nothing missing
    assert got == reference  # byte for byte


def test_random_and_named_kills_on_local_disk_resume_byte_identical(job, reference, tmp_path):
    spec, url = job[0], str(tmp_path / "out")
    out = reader(url)
    rng = random.Random(20240601)
    kills = kill_after_commits(start_submit(spec, url), out, 0, rng.uniform(0.5, 3.0))  # during start-up
    # Seeded random moments mid-run: after this run's n-th commit plus a fraction of one part's time, so
    # that a fast machine cannot finish the job inside the delay and leave the named kills nothing to do.
    part_s = seconds_per_part(reference[0])
    for more in rng.sample(range(1, 6), 2):
        commits = len(out.committed_part_ids()) + more
        kills += kill_after_commits(start_submit(spec, url), out, commits, rng.uniform(0.0, 1.0) * part_s)
    for point in ("after_part_data_written:2", "during_orphan_cleanup:1", "before_success:1"):
        code, _, err = submit(spec, url, kill_at=point)
        assert code == -signal.SIGKILL, (point, code, err[-3000:])
        kills += 1
    assert kills >= 5
    code, _, err = submit(spec, url)
    assert code == 0, err[-3000:]
    check_complete_output(job, url, reference[1])


def seconds_per_part(url: str) -> float:
    """Seconds between two commits of the uninterrupted run (its parts' modification times)."""
    times = sorted(p.stat().st_mtime for p in Path(url).rglob("*.parquet"))
    return (times[-1] - times[0]) / max(len(times) - 1, 1)


def test_kills_on_s3_resume_byte_identical(job, reference, monkeypatch):
    with moto_s3() as s3:
        for k, v in S3_ENV.items():
            monkeypatch.setenv(k, v)
        url = s3.url("chaos")
        proc = start_submit(job[0], url, env=s3.env)
        # Early in the run: under load a late threshold can be passed by a run that then simply finishes.
        assert kill_after_commits(proc, reader(url, s3.storage_options), 2, 0.0)
        code, _, err = submit(job[0], url, env=s3.env, kill_at="after_part_data_written:3")
        assert code == -signal.SIGKILL, err[-3000:]
        code, _, err = submit(job[0], url, env=s3.env)
        assert code == 0, err[-3000:]
        check_complete_output(job, url, reference[1], s3.storage_options)


def test_two_racing_submits_commit_every_row_once(job, reference, tmp_path):
    url = str(tmp_path / "out")
    procs = [start_submit(job[0], url), start_submit(job[0], url)]
    results = [(p.communicate(timeout=300), p.returncode) for p in procs]
    assert [code for _, code in results] == [0, 0], [r[0][1][-3000:] for r in results]
    check_complete_output(job, url, reference[1])


def test_finished_job_rerun_is_a_noop_and_a_changed_spec_exits_4(job, reference, tmp_path):
    url = str(tmp_path / "copy")
    shutil.copytree(reference[0], url)

    def mtimes() -> dict[str, int]:
        return {str(p): os.stat(p).st_mtime_ns for p in Path(url).rglob("*")}

    before = mtimes()
    code, _, err = submit(job[0], url)
    assert code == 0 and mtimes() == before, err[-3000:]  # nothing written
    code, _, err = submit(job[0], url, "--set", "sampling.seed=8")
    assert code == 4 and "sampling: seed: 7 -> 8" in err, err[-3000:]
    code, _, err = submit(job[0], url, "--set", "runtime.batch_size=16")  # not semantic: same job, done
    assert code == 0 and mtimes() == before, err[-3000:]


@pytest.mark.slow
def test_killed_ray_run_leaves_no_process_and_resumes_byte_identical(job, reference, tmp_path):
    """One run on the Ray executor (a local Ray started by the driver), killed mid-run with every process
    it started; resumed with the local executor — the executor is not part of the job's identity."""
    url = str(tmp_path / "out")
    proc = start_submit(job[0], url, "--set", "runtime.executor=ray", "--set", "runtime.engines=1",
                        env={"RAY_ADDRESS": ""})
    started: list[int] = []
    out = reader(url)
    while proc.poll() is None and len(out.committed_part_ids()) < 3:
        started = descendants(proc.pid) or started
        time.sleep(0.05)
    assert kill_after_commits(proc, out, 3, seconds_per_part(reference[0])), "the Ray run finished first"
    deadline = time.time() + 30
    while time.time() < deadline and any(alive(p) for p in started):
        time.sleep(0.2)
    assert not [p for p in started if alive(p)], "processes of the killed run survive"
    code, _, err = submit(job[0], url)
    assert code == 0, err[-3000:]
    check_complete_output(job, url, reference[1], same_command=False)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def test_unreachable_output_storage_exits_75(job):
    env = {**S3_ENV, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_MAX_ATTEMPTS": "1"}
    code, _, err = submit(job[0], "s3://nowhere/out", env=env)
    assert code == 75, err[-3000:]
