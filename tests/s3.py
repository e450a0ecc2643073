"""A real S3-compatible HTTP server for tests (moto's), which boto3 reaches over the network."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from core.config import S3Settings
from tests.processes import free_port


class S3Server:
    """moto's server on a port of its own; ``stop`` and ``start`` again keep the buckets (moto keeps
    them in this process), as an S3 outage does."""

    def __init__(self) -> None:
        self.port = free_port()
        self.settings = S3Settings(f"http://127.0.0.1:{self.port}", "testing", "testing", "us-east-1")
        self._server = None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        self._server.stop()


@contextmanager
def running_s3_server(bucket: str) -> Iterator[S3Server]:
    import boto3

    server = S3Server()
    server.start()
    try:
        boto3.client(
            "s3", endpoint_url=server.settings.endpoint_url, aws_access_key_id="testing",
            aws_secret_access_key="testing", region_name="us-east-1",
        ).create_bucket(Bucket=bucket)
        yield server
    finally:
        server.stop()


@contextmanager
def s3_server(bucket: str) -> Iterator[S3Settings]:
    with running_s3_server(bucket) as server:
        yield server.settings
