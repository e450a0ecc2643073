"""One boto3 client factory, so every S3 user honours the same endpoint and credentials."""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.config import S3Settings

if TYPE_CHECKING:
    from botocore.client import BaseClient


def s3_client(s3: S3Settings) -> BaseClient:
    import boto3  # deferred: processes that never touch S3 do not pay for importing boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=s3.endpoint_url,
        aws_access_key_id=s3.access_key_id,
        aws_secret_access_key=s3.secret_access_key,
        region_name=s3.region,
        # botocore waits 60 s for a connection by default, and retries: an unreachable S3 would
        # hold a request or a publish for minutes instead of seconds.
        config=Config(connect_timeout=3, read_timeout=30, retries={"mode": "standard", "max_attempts": 3}),
    )


def split_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix")``."""
    bucket, _, prefix = url[len("s3://") :].partition("/")
    return bucket, prefix.strip("/")
