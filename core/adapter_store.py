"""The dynamic LoRA path: where published adapters live, as ``<root>/<base_model_id>:<suffix>/``.

Publishing is atomic, so a reader never sees half an adapter:
- a local root holds each adapter as a symlink to an immutable version folder; publishing writes a
  new version folder, then swaps the link with ``os.replace`` (atomic, even over an old version);
- an ``s3://bucket/prefix`` root gets the weights first and ``adapter_config.json`` last, each
  object with its SHA-256 in its metadata, so a reader that finds the config finds complete,
  verifiable data.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
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


@dataclass(frozen=True)
class AdapterVersion:
    name: str
    version: str  # changes whenever the adapter is republished


class AdapterStore(Protocol):
    def publish(self, name: str, source_dir: Path) -> AdapterVersion: ...
    def version(self, name: str) -> AdapterVersion | None: ...
    def fetch(self, name: str, cache_dir: Path) -> Path: ...
    def delete(self, name: str) -> None: ...


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
        for file in _adapter_files(source_dir):
            shutil.copy2(file, staging / file.name)
        staging.rename(target)
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
        return AdapterVersion(name, resolved.name.rpartition("@")[2] or str(resolved.stat().st_mtime_ns))

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
        for file in _adapter_files(source_dir):
            self.client.upload_file(
                str(file), self.bucket, self.key(name, file.name),
                ExtraArgs={"Metadata": {"sha256": sha256_of(file), "version": version}},
            )  # fmt: skip
        return AdapterVersion(name, version)

    def version(self, name: str) -> AdapterVersion | None:
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self.key(name, CONFIG_FILE))
        except ClientError as exc:
            if exc.response["Error"]["Code"] in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return AdapterVersion(name, head["Metadata"].get("version") or head["ETag"].strip('"'))

    def fetch(self, name: str, cache_dir: Path) -> Path:
        """Download into ``cache_dir/<name>@<version>`` (verified, then renamed into place)."""
        current = self.version(name)
        if current is None:
            raise AdapterNotFound(name)
        target = cache_dir / f"{name}@{current.version}"
        if (target / CONFIG_FILE).is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".download-", dir=target.parent))
        try:
            listing = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.key(name) + "/")
            for item in listing.get("Contents", []):
                local = staging / item["Key"].rpartition("/")[2]
                self.client.download_file(self.bucket, item["Key"], str(local))
                expected = self.client.head_object(Bucket=self.bucket, Key=item["Key"])["Metadata"].get("sha256")
                if expected and sha256_of(local) != expected:
                    raise CorruptAdapter(f"{item['Key']}: checksum mismatch")
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target

    def delete(self, name: str) -> None:
        # The config first, so the adapter stops looking complete before its weights go.
        self.client.delete_object(Bucket=self.bucket, Key=self.key(name, CONFIG_FILE))
        listing = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.key(name) + "/")
        for item in listing.get("Contents", []):
            self.client.delete_object(Bucket=self.bucket, Key=item["Key"])


def adapter_store(root: str, s3: S3Settings) -> AdapterStore:
    """The store for a dynamic LoRA path: a local folder or ``s3://bucket/prefix``."""
    if root.startswith("s3://"):
        return S3AdapterStore(root, s3)
    return LocalAdapterStore(Path(root))
