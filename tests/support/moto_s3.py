"""A real S3 HTTP endpoint for tests: moto's ThreadedMotoServer on 127.0.0.1 with a free port.

Credentials are dummies set through the standard AWS environment variables; ``AWS_ENDPOINT_URL`` makes
every boto/s3fs client (including those of subprocesses, e.g. ``deepinfer-job``) talk to the server.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    bucket: str

    @property
    def env(self) -> dict[str, str]:
        """Environment for a subprocess that should use this server."""
        return {**S3_ENV, "AWS_ENDPOINT_URL": self.endpoint}

    @property
    def storage_options(self) -> dict:
        return {"client_kwargs": {"endpoint_url": self.endpoint}}

    def url(self, prefix: str | None = None) -> str:
        """A fresh ``s3://bucket/prefix`` for one test."""
        return f"s3://{self.bucket}/{prefix or uuid.uuid4().hex[:12]}"


@contextlib.contextmanager
def moto_s3() -> Iterator[S3Server]:
    """Start a moto S3 server with one bucket; the caller sets ``S3_ENV`` in its environment first."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        import boto3

        endpoint = f"http://127.0.0.1:{port}"
        saved = {k: os.environ.get(k) for k in S3_ENV}
        os.environ.update(S3_ENV)
        try:
            client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
            client.create_bucket(Bucket="deepinfer")
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        yield S3Server(endpoint=endpoint, bucket="deepinfer")
    finally:
        server.stop()
