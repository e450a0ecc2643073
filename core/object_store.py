"""Where uploaded files and checkpoints are kept: a local folder, or ``s3://bucket/prefix``."""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from core.config import S3Settings
from core.s3 import s3_client, split_s3_url


class ObjectNotFound(KeyError):
    """No object has this key (the same exception from every kind of store)."""


class ObjectStore(Protocol):
    def put(self, key: str, data: bytes) -> None: ...
    def put_stream(self, key: str, stream: BinaryIO) -> None: ...  # read to its end, a chunk at a time
    def put_file(self, key: str, path: Path) -> None: ...
    def get(self, key: str) -> bytes: ...
    def open(self, key: str) -> BinaryIO: ...  # read a block or a line at a time; the caller closes it
    def delete_prefix(self, prefix: str) -> None: ...


class LocalObjectStore:
    def __init__(self, root: Path):
        self.root = root

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.root.resolve()):  # keys are ours, but never trust a path
            raise ValueError(f"object key {key!r} escapes the store")
        return path

    def put(self, key: str, data: bytes) -> None:
        self.put_stream(key, io.BytesIO(data))

    def put_stream(self, key: str, stream: BinaryIO) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as handle:
            shutil.copyfileobj(stream, handle)
        os.replace(handle.name, path)  # readers see the old object or the new one, never half

    def put_file(self, key: str, path: Path) -> None:
        with path.open("rb") as stream:
            self.put_stream(key, stream)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectNotFound(key) from None

    def open(self, key: str) -> BinaryIO:
        try:
            return self._path(key).open("rb")
        except FileNotFoundError:
            raise ObjectNotFound(key) from None

    def delete_prefix(self, prefix: str) -> None:
        target = self._path(prefix)
        if target.is_file():
            target.unlink()
        elif target.is_dir():
            for path in sorted(target.rglob("*"), reverse=True):
                path.unlink() if path.is_file() else path.rmdir()
            target.rmdir()


class S3ObjectStore:
    def __init__(self, url: str, s3: S3Settings):
        self.bucket, self.prefix = split_s3_url(url)
        self.client = s3_client(s3)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def put_stream(self, key: str, stream: BinaryIO) -> None:
        self.client.upload_fileobj(stream, self.bucket, self._key(key))  # in parts, for a large one

    def put_file(self, key: str, path: Path) -> None:
        self.client.upload_file(str(path), self.bucket, self._key(key))

    def get(self, key: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            raise ObjectNotFound(key) from None

    def open(self, key: str) -> BinaryIO:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
        except self.client.exceptions.NoSuchKey:
            raise ObjectNotFound(key) from None
        return io.BufferedReader(_Body(body), buffer_size=_READ_BLOCK)

    def delete_prefix(self, prefix: str) -> None:
        listing = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self._key(prefix))
        for item in listing.get("Contents", []):
            self.client.delete_object(Bucket=self.bucket, Key=item["Key"])


_READ_BLOCK = 256 * 1024


class _Body(io.RawIOBase):
    """An S3 object's body as a raw stream, read from the network as it is asked for: buffered, it
    reads by lines (``readline``) as a local file does."""

    def __init__(self, body: Any):
        self._body = body

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._body.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._body.close()
        super().close()


def object_store(root: str, s3: S3Settings) -> ObjectStore:
    return S3ObjectStore(root, s3) if root.startswith("s3://") else LocalObjectStore(Path(root))
