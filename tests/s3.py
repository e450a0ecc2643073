"""A real S3-compatible HTTP server for tests (moto's), which boto3 reaches over the network."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from core.config import S3Settings
from tests.processes import free_port


@contextmanager
def s3_server(bucket: str) -> Iterator[S3Settings]:
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    settings = S3Settings(f"http://127.0.0.1:{port}", "testing", "testing", "us-east-1")
    try:
        boto3.client(
            "s3", endpoint_url=settings.endpoint_url, aws_access_key_id="testing",
            aws_secret_access_key="testing", region_name="us-east-1",
        ).create_bucket(Bucket=bucket)  # fmt: skip
        yield settings
    finally:
        server.stop()
