"""The dynamic LoRA path: where published adapters live, as ``<root>/<base_model_id>:<suffix>/``.

Each publish is a revision, ``<name>@r<N>``: a complete adapter of its own in the store, which never
changes afterwards. ``<name>`` itself points at one of them (the latest, or the one rolled back to),
so readers of the bare name see a whole revision or the one before, never half of one:
- a local root holds each revision in an immutable folder (``.versions/<name>@r<N>``) and the
  name as a symlink to one of them; moving it is ``os.replace`` of a new link (atomic);
- an ``s3://bucket/prefix`` root holds each revision under ``<name>@r<N>/``, and a copy of the one
  pointed at under ``<name>/``. Objects are written weights first and ``adapter_config.json`` last,
  each with its SHA-256 and the revision in its metadata, so a reader that finds the config finds
  complete, verifiable data; a reader that meets objects of another revision (a move under way)
  starts again, and caches nothing until every object it read carries the config's revision.

Every write of a revision also gets a publish id of its own (random), which no other write ever has:
a name deleted and published again (by another organization, say) is ``r1`` again, but not the same
publish. Caches are keyed by it, never by the name and revision alone, so nothing cached from the
deleted adapter (a synced copy, an adapter an engine holds) answers for the new one. A local
revision's folder holds it in a small file (``publish_id``, there before the folder is renamed into
place); on S3 every object carries it in its metadata (the config's, written last, is what the
version's HEAD reads), and a synced copy gets the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from core.catalog import BaseModel
from core.config import S3Settings
from core.model_names import revision_in, revision_tag, with_revision
from core.s3 import s3_client, split_s3_url

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PUBLISH_ID_FILE = "publish_id"  # in an adapter's folder: the publish it holds (see the module docstring)
_VERSIONS = ".versions"  # local: the immutable revision folders behind the published links


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
    version: str  # the revision the name points at, ``r<N>`` (a timestamp for adapters published before revisions)
    publish_id: str = ""  # the write of that revision (empty for adapters published before publish ids)

    @property
    def identity(self) -> str:
        """What caches key this content by: unique to one publish, whatever its name and revision."""
        return self.publish_id or self.version


class AdapterStore(Protocol):
    def publish(self, name: str, source_dir: Path, revision: int | None = None) -> AdapterVersion:
        """Write revision ``revision`` of ``name`` from ``source_dir`` (by default the one after the
        store's latest), then point ``name`` at it."""
        ...

    def write_revision(self, name: str, revision: int, source_dir: Path) -> str:
        """Write revision ``revision`` of ``name``, servable pinned (``<name>@r<N>``); ``name`` does not
        move. The write's publish id."""
        ...

    def point(self, name: str, revision: int) -> None:
        """Make ``name`` answer with one of its published revisions (a rollback)."""
        ...

    def version(self, name: str) -> AdapterVersion | None: ...
    def fetch(self, name: str, cache_dir: Path) -> Path: ...

    def config(self, name: str) -> dict:
        """The published ``adapter_config.json`` of ``name`` alone (its rank, its modules), without
        its weights; ``AdapterNotFound`` when it is not published."""
        ...

    def delete(self, name: str) -> None:
        """``name`` and all its revisions; a pinned name (``<name>@r<N>``) deletes that revision alone."""
        ...


def _next_revision(published: list[str]) -> int:
    """One after the highest of the revision names (``<anything>@r<N>``) in ``published``."""
    numbers = [number for number in map(revision_in, published) if number is not None]
    return max(numbers, default=0) + 1


def cached_copy(cache_dir: Path, name: str, identity: str) -> Path:
    """Where a store's copy of one publish of an adapter (``AdapterVersion.identity``) is kept in a
    local cache."""
    return cache_dir / f"{name}@{identity}"


def version_of_folder(folder: Path) -> str:
    """Version folders (local revisions, and S3 copies in a cache) are named ``<name>@<version>``."""
    return folder.name.rpartition("@")[2]


def _new_publish_id() -> str:
    return secrets.token_hex(8)


def publish_id_of(folder: Path) -> str:
    """The publish a folder holds (its ``publish_id`` file); empty for one published before them."""
    try:
        return (folder / PUBLISH_ID_FILE).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return ""


def identity_of_folder(folder: Path) -> str:
    """``AdapterVersion.identity`` of the adapter a folder holds: its publish id, or for an adapter
    published before them the version its folder's name ends with."""
    return publish_id_of(folder) or version_of_folder(folder)


def holds_publish(folder: Path, identity: str) -> bool:
    """The folder holds a complete copy of exactly this publish: a cache hit, checked."""
    return (folder / CONFIG_FILE).is_file() and identity_of_folder(folder) == identity


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _adapter_files(source_dir: Path) -> list[Path]:
    """The files a published adapter holds (a checkpoint's training state beside them stays out)."""
    files = [source_dir / WEIGHTS_FILE, source_dir / CONFIG_FILE]
    # The config goes last: its presence is what tells readers the adapter is complete.
    if not all(file.is_file() for file in files):
        raise FileNotFoundError(f"{source_dir} must hold {CONFIG_FILE} and {WEIGHTS_FILE}")
    return files


class LocalAdapterStore:
    def __init__(self, root: Path):
        self.root = root

    def path(self, name: str) -> Path:
        """The published link of a name; a revision's own folder for a pinned name."""
        return self.root / _VERSIONS / name if revision_in(name) is not None else self.root / name

    def publish(self, name: str, source_dir: Path, revision: int | None = None) -> AdapterVersion:
        if revision is None:
            revision = _next_revision([folder.name for folder in self._revision_folders(name)])
        publish_id = self.write_revision(name, revision, source_dir)
        self.point(name, revision)
        return AdapterVersion(name, revision_tag(revision), publish_id)

    def write_revision(self, name: str, revision: int, source_dir: Path) -> str:
        target = self.path(with_revision(name, revision))
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
        try:
            for file in _adapter_files(source_dir):
                shutil.copy2(file, staging / file.name)
            publish_id = _new_publish_id()
            (staging / PUBLISH_ID_FILE).write_text(publish_id)
            if target.exists():  # an attempt given up on published this revision: the last attempt's wins
                target.rename(staging.with_suffix(".replaced"))
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # a full disk leaves no partial copy behind
            shutil.rmtree(staging.with_suffix(".replaced"), ignore_errors=True)
        return publish_id

    def point(self, name: str, revision: int) -> None:
        target = self.path(with_revision(name, revision))
        if not (target / CONFIG_FILE).is_file():
            raise AdapterNotFound(with_revision(name, revision))
        link = self.path(name)
        link.parent.mkdir(parents=True, exist_ok=True)
        temporary_link = link.with_name(f".{link.name}.{time.time_ns()}.link")
        temporary_link.symlink_to(os.path.relpath(target, link.parent))
        os.replace(temporary_link, link)

    def version(self, name: str) -> AdapterVersion | None:
        link = self.path(name)
        if not (link / CONFIG_FILE).is_file():
            return None
        resolved = link.resolve()
        version = version_of_folder(resolved) or str(resolved.stat().st_mtime_ns)
        return AdapterVersion(name, version, publish_id_of(resolved))

    def fetch(self, name: str, cache_dir: Path) -> Path:
        """A local store is already local: the published folder is what a replica loads."""
        resolved = self.path(name).resolve()
        if not (resolved / CONFIG_FILE).is_file():
            raise AdapterNotFound(name)
        return resolved

    def config(self, name: str) -> dict:
        try:
            return json.loads((self.path(name) / CONFIG_FILE).read_text())
        except FileNotFoundError:
            raise AdapterNotFound(name) from None

    def delete(self, name: str) -> None:
        link = self.path(name)
        if revision_in(name) is not None:
            shutil.rmtree(link, ignore_errors=True)
        elif link.is_symlink():
            link.unlink()
            for revision in self._revision_folders(name):
                shutil.rmtree(revision, ignore_errors=True)
        elif link.is_dir():
            shutil.rmtree(link)

    def _revision_folders(self, name: str) -> list[Path]:
        return list((self.root / _VERSIONS / name).parent.glob(f"{Path(name).name}@*"))


class S3AdapterStore:
    def __init__(self, url: str, s3: S3Settings):
        self.bucket, self.prefix = split_s3_url(url)
        self.client = s3_client(s3)

    def key(self, name: str, filename: str = "") -> str:
        return "/".join(part for part in (self.prefix, name, filename) if part)

    def publish(self, name: str, source_dir: Path, revision: int | None = None) -> AdapterVersion:
        if revision is None:
            with _unavailable_on_network_errors():
                listing = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.key(name) + "@")
            revision = _next_revision([item["Key"].rpartition("/")[0] for item in listing.get("Contents", [])])
        publish_id = self.write_revision(name, revision, source_dir)
        self.point(name, revision)
        return AdapterVersion(name, revision_tag(revision), publish_id)

    def write_revision(self, name: str, revision: int, source_dir: Path) -> str:
        publish_id = _new_publish_id()
        publish = {"version": revision_tag(revision), PUBLISH_ID_METADATA: publish_id}
        with _unavailable_on_network_errors():
            for file in _adapter_files(source_dir):
                self.client.upload_file(
                    str(file), self.bucket, self.key(with_revision(name, revision), file.name),
                    ExtraArgs={"Metadata": {"sha256": sha256_of(file), **publish}},
                )
        return publish_id

    def point(self, name: str, revision: int) -> None:
        """Copy the revision's objects over the name's, in the store (no download), config last."""
        source = with_revision(name, revision)
        if self.version(source) is None:
            raise AdapterNotFound(source)
        with _unavailable_on_network_errors():
            for filename in (WEIGHTS_FILE, CONFIG_FILE):  # the copy keeps the metadata: checksum and revision
                self.client.copy_object(
                    Bucket=self.bucket, Key=self.key(name, filename),
                    CopySource={"Bucket": self.bucket, "Key": self.key(source, filename)},
                    # computed afresh: a multipart upload's checksum (of its parts) does not fit the copy
                    ChecksumAlgorithm="CRC32",
                )

    def version(self, name: str) -> AdapterVersion | None:
        from botocore.exceptions import ClientError

        try:
            with _unavailable_on_network_errors():
                head = self.client.head_object(Bucket=self.bucket, Key=self.key(name, CONFIG_FILE))
        except ClientError as exc:
            if exc.response["Error"]["Code"] in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        metadata = head["Metadata"]
        return AdapterVersion(
            name, metadata.get("version") or head["ETag"].strip('"'), metadata.get(PUBLISH_ID_METADATA, "")
        )

    def fetch(self, name: str, cache_dir: Path) -> Path:
        """Download into ``cache_dir/<name>@<identity>`` (verified, then renamed into place); a copy
        there already is used when it holds this very publish."""
        for attempt in range(_FETCH_ATTEMPTS):
            current = self.version(name)
            if current is None:
                raise AdapterNotFound(name)
            target = cached_copy(cache_dir, name, current.identity)
            if holds_publish(target, current.identity):
                return target
            shutil.rmtree(target, ignore_errors=True)  # not this publish (an older pool's copy): fetched again
            try:
                with _unavailable_on_network_errors():
                    self._download(name, current, target)
                return target
            except _VersionMoved:
                time.sleep(0.1 * 2**attempt)  # the publisher writes the config last: give it time
        raise StoreUnavailable(f"{name} kept changing while it was read ({_FETCH_ATTEMPTS} tries)")

    def config(self, name: str) -> dict:
        from botocore.exceptions import ClientError

        try:
            with _unavailable_on_network_errors():
                answer = self.client.get_object(Bucket=self.bucket, Key=self.key(name, CONFIG_FILE))
                return json.loads(answer["Body"].read())
        except ClientError as exc:
            if exc.response["Error"]["Code"] in ("404", "NoSuchKey", "NotFound"):
                raise AdapterNotFound(name) from None
            raise

    def _download(self, name: str, current: AdapterVersion, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".download-", dir=target.parent))
        try:
            listing = self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.key(name) + "/")
            for item in listing.get("Contents", []):
                filename = item["Key"].rpartition("/")[2]
                # Body and metadata from one GET: they belong to the same write of the object.
                answer = self.client.get_object(Bucket=self.bucket, Key=item["Key"])
                if not _of_publish(answer["Metadata"], current):
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
            if current.publish_id:
                (staging / PUBLISH_ID_FILE).write_text(current.publish_id)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def delete(self, name: str) -> None:
        # The config first, so the adapter stops looking complete before its weights go.
        self.client.delete_object(Bucket=self.bucket, Key=self.key(name, CONFIG_FILE))
        prefixes = [self.key(name) + "/"] + ([] if revision_in(name) is not None else [self.key(name) + "@"])
        for prefix in prefixes:  # the name's own objects, then its revisions'
            listing = self.client.list_objects_v2(Bucket=self.bucket, Prefix=prefix)
            for item in listing.get("Contents", []):
                self.client.delete_object(Bucket=self.bucket, Key=item["Key"])


PUBLISH_ID_METADATA = "publish-id"  # S3 metadata: the publish an object was written by


def _of_publish(metadata: dict[str, str], current: AdapterVersion) -> bool:
    """An object written by the publish the config names (objects from before revisions or publish
    ids carry neither, and belong to whatever the config says)."""
    same_revision = metadata.get("version") in (None, current.version)
    return same_revision and metadata.get(PUBLISH_ID_METADATA, "") == current.publish_id


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


def store_of(model: BaseModel, s3: S3Settings) -> AdapterStore:
    """Where base model ``model``'s fine-tunes are published: the dynamic LoRA path its catalog
    ``lora_config`` names."""
    return adapter_store(model.lora.dynamic_lora_loading_path, s3)
