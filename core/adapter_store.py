"""The dynamic LoRA path: where published adapters live, as ``<root>/<base_model_id>:<suffix>/``.

Publishing is atomic, so a reader never sees half an adapter:
- a local root holds each adapter as a symlink to an immutable version folder; publishing writes a
  new version folder, then swaps the link with ``os.replace`` (atomic, even over an old version);
- an ``s3://bucket/prefix`` root gets the weights first and ``adapter_config.json`` last, each
  object with its SHA-256 and the version in its metadata, so a reader that finds the config finds
  complete, verifiable data; a reader that meets objects of another version (a republish under
  way) starts again, and caches nothing until every object it read carries the config's version.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from core.config import S3Settings
from core.s3 import s3_client, split_s3_url

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_VERSIONS = ".versions"  # local: immutable version folders behind the published links


class AdapterNotFound(LookupError):
    pass


class CorruptAdapter(ValueError):
    """Downloaded bytes do not match the checksum they were published with."""


class StoreUnavailable(OSError):
    """The store did not answer (S3 down, a network error, or a republish that never settled)."""


class _VersionMoved(Exception):
    """An object of another version than the config's: the adapter is being republished."""


_FETCH_ATTEMPTS = 5


@dataclass(frozen=True)
class AdapterVersion:
    name: str
    version: str  # changes whenever the adapter is republished


class AdapterStore(Protocol):
    def publish(self, name: str, source_dir: Path) -> AdapterVersion: ...
    def version(self, name: str) -> AdapterVersion | None: ...
    def fetch(self, name: str, cache_dir: Path) -> Path: ...
    def delete(self, name: str) -> None: ...


def version_of_folder(folder: Path) -> str:
    """Version folders (local, and S3 copies in a cache) are named ``<name>@<version>``."""
    return folder.name.rpartition("@")[2]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _adapter_files(source_dir: Path) -> list[Path]:
    files = sorted(p for p in source_dir.iterdir() if p.is_file())
    names = {p.name for p in files}
    if CONFIG_FILE not in names or WEIGHTS_FILE not in names:
        raise FileNotFoundError(f"{source_dir} must hold {CONFIG_FILE} and {WEIGHTS_FILE}")
    # The config goes last: its presence is what tells readers the adapter is complete.
    return [p for p in files if p.name != CONFIG_FILE] + [source_dir / CONFIG_FILE]


class LocalAdapterStore:
    def __init__(self, root: Path):
        self.root = root

    def path(self, name: str) -> Path:
        return self.root / name

    def publish(self, name: str, source_dir: Path) -> AdapterVersion:
        link = self.path(name)
        version = f"{time.time_ns()}"
        target = self.root / _VERSIONS / f"{name}@{version}"
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
        try:
            for file in _adapter_files(source_dir):
                shutil.copy2(file, staging / file.name)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # a full disk leaves no partial copy behind
        link.parent.mkdir(parents=True, exist_ok=True)
        previous = link.resolve() if link.is_symlink() else None
        temporary_link = link.with_name(f".{link.name}.{version}.link")
        temporary_link.symlink_to(os.path.relpath(target, link.parent))
        os.replace(temporary_link, link)
        # The version just replaced stays one round, for a reader that resolved the link a moment
        # ago and is still loading it; anything older goes.
        for stale in target.parent.glob(f"{Path(name).name}@*"):
            if stale not in (target, previous):
                shutil.rmtree(stale, ignore_errors=True)
        return AdapterVersion(name, version)

    def version(self, name: str) -> AdapterVersion | None:
        link = self.path(name)
        if not (link / CONFIG_FILE).is_file():
            return None
        resolved = link.resolve()
        return AdapterVersion(name, version_of_folder(resolved) or str(resolved.stat().st_mtime_ns))

    def fetch(self, name: str, cache_dir: Path) -> Path:
        """A local store is already local: the published folder is what a replica loads."""
        resolved = self.path(name).resolve()
        if not (resolved / CONFIG_FILE).is_file():
            raise AdapterNotFound(name)
        return resolved

    def delete(self, name: str) -> None:
        link = self.path(name)
        if link.is_symlink():
            link.unlink()
            for version in (self.root / _VERSIONS / name).parent.glob(f"{Path(name).name}@*"):
                shutil.rmtree(version, ignore_errors=True)
        elif link.is_dir():
            shutil.rmtree(link)


class S3AdapterStore:
    def __init__(self, url: str, s3: S3Settings):
        self.bucket, self.prefix = split_s3_url(url)
        self.client = s3_client(s3)

    def key(self, name: str, filename: str = "") -> str:
        return "/".join(part for part in (self.prefix, name, filename) if part)

    def publish(self, name: str, source_dir: Path) -> AdapterVersion:
        version = f"{time.time_ns()}"
        with _unavailable_on_network_errors():
            for file in _adapter_files(source_dir):
                self.client.upload_file(
                    str(file), self.bucket, self.key(name, file.name),
                    ExtraArgs={"Metadata": {"sha256": sha256_of(file), "version": version}},
                )  # fmt: skip
        return AdapterVersion(name, version)

    def version(self, name: str) -> AdapterVersion | None:
        from botocore.exceptions import ClientError

        try:
            with _unavailable_on_network_errors():
                head = self.client.head_object(Bucket=self.bucket, Key=self.key(name, CONFIG_FILE))
        except ClientError as exc:
            if exc.response["Error"]["Code"] in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return AdapterVersion(name, head["Metadata"].get("version") or head["ETag"].strip('"'))

    def fetch(self, name: str, cache_dir: Path) -> Path:
        """Download into ``cache_dir/<name>@<version>`` (verified, then renamed into place)."""
        for attempt in range(_FETCH_ATTEMPTS):
            current = self.version(name)
            if current is None:
                raise AdapterNotFound(name)
            target = cache_dir / f"{name}@{current.version}"
            if (target / CONFIG_FILE).is_file():
                return target
            try:
                with _unavailable_on_network_errors():
                    self._download(name, current.version, target)
                return target
            except _VersionMoved:
                time.sleep(0.1 * 2**attempt)  # the publisher writes the config last: give it time
        raise StoreUnavailable(f"{name} kept changing while it was read ({_FETCH_ATTEMPTS} tries)")

    def _download(self, name: str, version: str, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".download-", dir=target.parent))
        try:
            listing = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.key(name) + "/")
            for item in listing.get("Contents", []):
                filename = item["Key"].rpartition("/")[2]
                # Body and metadata from one GET: they belong to the same write of the object.
                answer = self.client.get_object(Bucket=self.bucket, Key=item["Key"])
                published_as = answer["Metadata"].get("version")
                if published_as not in (None, version):
                    if filename in (CONFIG_FILE, WEIGHTS_FILE):
                        raise _VersionMoved(item["Key"])
                    continue  # a file an older version had and this one does not
                digest = hashlib.sha256()
                with (staging / filename).open("wb") as local:
                    for block in answer["Body"].iter_chunks(1 << 20):
                        digest.update(block)
                        local.write(block)
                expected = answer["Metadata"].get("sha256")
                if expected and digest.hexdigest() != expected:
                    raise CorruptAdapter(f"{item['Key']}: checksum mismatch")
            if not (staging / CONFIG_FILE).is_file() or not (staging / WEIGHTS_FILE).is_file():
                raise _VersionMoved(name)  # deleted or being replaced while listed
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def delete(self, name: str) -> None:
        # The config first, so the adapter stops looking complete before its weights go.
        self.client.delete_object(Bucket=self.bucket, Key=self.key(name, CONFIG_FILE))
        listing = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.key(name) + "/")
        for item in listing.get("Contents", []):
            self.client.delete_object(Bucket=self.bucket, Key=item["Key"])


@contextlib.contextmanager
def _unavailable_on_network_errors() -> Iterator[None]:
    """S3 that cannot be reached (or answers 5xx) is ``StoreUnavailable``: a reader waits and
    retries; it is not told the adapter is missing or broken."""
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except (BotoCoreError, S3UploadFailedError) as exc:
        raise StoreUnavailable(str(exc)) from exc
    except ClientError as exc:
        if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) >= 500:
            raise StoreUnavailable(str(exc)) from exc
        raise


def adapter_store(root: str, s3: S3Settings) -> AdapterStore:
    """The store for a dynamic LoRA path: a local folder or ``s3://bucket/prefix``."""
    if root.startswith("s3://"):
        return S3AdapterStore(root, s3)
    return LocalAdapterStore(Path(root))
