"""A job with input and output on s3://, through a real S3 HTTP endpoint (moto's server on 127.0.0.1).

Credentials travel only through the standard AWS environment variables; the test checks that the secret
never shows up in the CLI's output or in any object the job wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.pipeline_helpers import review_rows, write_spec

ACCESS_KEY = "AKIADEEPINFERTEST01"
SECRET_KEY = "s3cr3t-deepinfer-e2e-do-not-leak-9f27c1"
BUCKET = "deepinfer-e2e"


@pytest.fixture(scope="module")
def s3_endpoint():
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture()
def aws_env(monkeypatch) -> dict[str, str]:
    env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
           "AWS_DEFAULT_REGION": "us-east-1"}
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def test_s3_round_trip_keeps_credentials_out_of_logs_and_output(tmp_path, s3_endpoint, aws_env,
                                                                tiny_checkpoint) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint)
    fs.mkdir(BUCKET)
    for name, start, n in (("in/a.jsonl", 0, 3), ("in/b.jsonl", 3, 2)):
        fs.pipe(f"{BUCKET}/{name}", "".join(json.dumps(r) + "\n" for r in review_rows(n, start)).encode())
    doc = {
        "model": {"path": str(tiny_checkpoint("llama"))},
        "input": {"path": f"s3://{BUCKET}/in/*.jsonl", "format": "jsonl", "id_column": "rid",
                  "storage_options": {"endpoint_url": s3_endpoint}},
        "prompt": {"mode": "chat", "template": "{{ text }}"},
        "sampling": {"max_tokens": 5, "seed": 3},
        "output": {"path": f"s3://{BUCKET}/out/run-1", "keep_columns": ["topic"],
                   "storage_options": {"endpoint_url": s3_endpoint}},
        "runtime": {"executor": "ray", "rows_per_part": 2, "engines": 1},
    }
    spec = write_spec(tmp_path / "s3_job.yaml", doc)
    env = {**os.environ, **aws_env, "RAY_ADDRESS": ""}
    proc = subprocess.run([sys.executable, "-m", "deepinfer.pipeline.cli", "submit", spec, "--summary-json",
                           str(tmp_path / "summary.json")], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Ray's own log noise is replaced by deepinfer's progress lines unless -v.
    assert all(line.startswith("[deepinfer]") for line in proc.stderr.splitlines() if line.strip())

    fs.invalidate_cache()
    names = sorted(p.removeprefix(f"{BUCKET}/out/run-1/") for p in fs.find(f"{BUCKET}/out/run-1"))
    assert "_SUCCESS" in names and "_job.json" in names
    parts = [n for n in names if n.startswith("parts/")]
    assert [p[6:22] for p in parts] == ["00000-0000000000", "00000-0000000002", "00001-0000000000"]
    rows = pa.concat_tables([pq.read_table(fs.open(f"{BUCKET}/out/run-1/{p}")) for p in parts])
    assert rows.column("rid").to_pylist() == [f"r{i:03d}" for i in range(5)]
    assert rows.column("topic").to_pylist() == [r["topic"] for r in review_rows(5)]

    texts = [proc.stdout, proc.stderr, (tmp_path / "summary.json").read_text()]
    texts += [fs.cat(f"{BUCKET}/out/run-1/{n}").decode("utf-8", "replace") for n in names]
    for text in texts:
        assert SECRET_KEY not in text and ACCESS_KEY not in text

    from deepinfer.pipeline.cli.status_cmd import resolve_target
    from deepinfer.pipeline.output.status import job_status

    url, options = resolve_target(spec, [])
    status = job_status(url, options)
    assert status["state"] == "complete" and status["committed_rows"] == 5
