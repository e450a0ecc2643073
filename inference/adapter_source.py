"""One base model's dynamic LoRA path, as the pool sees it.

It answers "which version is published now?" on every request (a local path is a few system calls;
S3 a HEAD, remembered for a second), and gives a local folder for a version: the published folder
itself, or an S3 copy synced into a cache, checksum-verified, downloaded once however many requests
want it at the same moment. A missing adapter is never remembered: the next request looks again.

Copies in the cache are keyed by publish (``AdapterVersion.identity``), never by name and revision
alone: a name deleted and published again is ``r1`` again, and must not find the deleted adapter's
copy. A local store's adapter is read where it lies, through a link in the cache named the same way:
vLLM keys its prefix cache by an adapter's name and path, and the new publish's folder in the store
has the deleted one's path. A copy (or link) leaves the cache when no replica holds it any more
(``prune_cache``, on an eviction or a deletion), and any no replica holds or asked for in
``UNUSED_COPY_TTL_S`` goes with ``sweep_cache`` (a load that failed, a mix's parts, what a previous
run of the pool left).

When S3 is slow or unreachable, an adapter whose version is known keeps answering with it (the
look-up goes on in the background and corrects it once S3 answers); one never seen before is a
503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import shutil
import time
from pathlib import Path

from core.adapter_store import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterNotFound,
    AdapterStore,
    AdapterVersion,
    CorruptAdapter,
    LocalAdapterStore,
    StoreUnavailable,
    cached_copy,
    holds_publish,
    identity_of_folder,
)
from core import api_errors
from inference.metrics import Metrics

REMOTE_VERSION_TTL_S = 1.0  # how long an S3 version answer is trusted (a found one; never a missing one)
KNOWN_VERSION_WAIT_S = 0.5  # how long a request for a known adapter waits for S3 before using what it knows
UNUSED_COPY_TTL_S = 600.0  # a cached copy no replica holds goes once it was not asked for in this long

log = logging.getLogger("inference.adapter_source")


class AdapterSource:
    """One base model's dynamic LoRA path, as seen by the pool."""

    def __init__(self, store: AdapterStore, cache_dir: Path, metrics: Metrics, base_model_id: str):
        self.store, self.cache_dir, self.metrics, self.base_model_id = store, cache_dir, metrics, base_model_id
        self.is_local = isinstance(store, LocalAdapterStore)
        self._known: dict[str, tuple[AdapterVersion, float]] = {}  # S3: name -> (version, checked at)
        # name -> (HEAD in flight, started)
        self._lookups: dict[str, tuple[asyncio.Task[AdapterVersion | None], float]] = {}
        self._store_down = False  # the last look-up failed: known versions answer without waiting
        self._answered_at = 0.0  # when a look-up last succeeded
        self._fetches: dict[tuple[str, str], asyncio.Task[Path]] = {}

    async def version(self, name: str) -> AdapterVersion | None:
        if self.is_local:
            return self.store.version(name)  # a stat, a readlink and a small read: cheaper than a thread hop
        known = self._known.get(name)
        if known and time.monotonic() - known[1] < REMOTE_VERSION_TTL_S:
            return known[0]
        lookup = asyncio.shield(self._look_up(name))
        if known is None:
            try:
                return await lookup
            except StoreUnavailable as exc:
                raise api_errors.adapter_store_unavailable(name, str(exc)) from None
        try:
            return await asyncio.wait_for(lookup, 0 if self._store_down else KNOWN_VERSION_WAIT_S)
        except (TimeoutError, StoreUnavailable):
            return known[0]

    async def current_version(self, name: str) -> AdapterVersion | None:
        """What the store says now, asked now: for a caller that knows of a publish this source may
        not have seen yet (its answer is trusted for ``REMOTE_VERSION_TTL_S``, a look-up in flight
        may have started before the publish)."""
        if self.is_local:
            return self.store.version(name)
        try:
            return await self._head(name)
        except StoreUnavailable as exc:
            raise api_errors.adapter_store_unavailable(name, str(exc)) from None

    def _look_up(self, name: str) -> asyncio.Task[AdapterVersion | None]:
        """One HEAD in flight per adapter; it updates what is known, whoever is still waiting. One
        started before S3 answered again (still retrying the outage) is not joined: it would fail
        late, and its caller would keep the old version though S3 has a new one."""
        in_flight = self._lookups.get(name)
        if in_flight is not None and in_flight[1] >= self._answered_at:
            return in_flight[0]
        started = time.monotonic()
        task = asyncio.create_task(self._head(name))
        self._lookups[name] = (task, started)
        task.add_done_callback(functools.partial(self._looked_up, name, started))
        return task

    def _looked_up(self, name: str, started: float, task: asyncio.Task) -> None:
        if self._lookups.get(name, (None, 0.0))[0] is task:
            del self._lookups[name]
        failure = None if task.cancelled() else task.exception()  # retrieved even when nobody waited
        if failure is None:
            self._answered_at = time.monotonic()
        elif started < self._answered_at:
            return  # a look-up from before S3 answered again, failing late: S3 is not down now
        if isinstance(failure, StoreUnavailable) != self._store_down:
            self._store_down = not self._store_down
            if self._store_down:
                log.warning("S3 does not answer (%s): loaded adapters keep their versions until it does", failure)
            else:
                log.info("S3 answers again: adapter versions are checked again")

    async def _head(self, name: str) -> AdapterVersion | None:
        found = await asyncio.to_thread(self.store.version, name)
        if found is None:
            self._known.pop(name, None)
            return None
        self._known[name] = (found, time.monotonic())
        return found

    async def folder(self, name: str, identity: str) -> Path:
        """A local folder holding this adapter, this publish of it (``AdapterVersion.identity``) when
        the store still has it; for S3 one download however many callers wait."""
        if self.is_local:
            return _linked(self.store.fetch(name, self.cache_dir), self.cache_dir, name)
        cached = cached_copy(self.cache_dir, name, identity)
        if holds_publish(cached, identity):  # this publish was downloaded and verified already
            _touch(cached)  # asked for: not unused (``sweep_cache``)
            return cached
        key = (name, identity)
        task = self._fetches.get(key)
        if task is None:
            task = asyncio.create_task(self._download(name))
            self._fetches[key] = task
            task.add_done_callback(lambda _: self._fetches.pop(key, None))
        return await asyncio.shield(task)

    async def checked_folder(self, name: str, identity: str, max_rank: int) -> Path:
        """``folder``, checked as vLLM would check it: an ``ApiError`` saying what is wrong otherwise."""
        try:
            folder = await self.folder(name, identity)
        except AdapterNotFound:
            raise api_errors.adapter_not_found(name) from None
        except CorruptAdapter as exc:
            raise api_errors.adapter_invalid(name, f"its files do not match their checksums ({exc})") from None
        except StoreUnavailable as exc:
            raise api_errors.adapter_store_unavailable(name, str(exc)) from None
        check_adapter(name, folder, max_rank)
        return folder

    async def _download(self, name: str) -> Path:
        started = time.perf_counter()
        folder = await asyncio.to_thread(self.store.fetch, name, self.cache_dir)
        self.metrics.adapter_downloads.labels(self.base_model_id).inc()
        self.metrics.adapter_download_seconds.labels(self.base_model_id).observe(time.perf_counter() - started)
        return folder

    def prune_cache(self, name: str, in_use: set[Path], newest: Path | None = None) -> None:
        """Drop synced copies that no replica holds: older than ``newest``, or all when it is None."""
        prefix = self.cache_dir / name
        newest_at = _modified_ns(newest) if newest is not None else None
        for folder in prefix.parent.glob(f"{prefix.name}@*"):
            if folder in in_use or folder == newest or any(key[0] == name for key in self._fetches):
                continue
            # A copy newer than the one just loaded may be about to load on another replica.
            if newest_at is None or _modified_ns(folder) < newest_at:
                _remove(folder)

    def sweep_cache(self, in_use: set[Path]) -> None:
        """Drop every copy in the cache that no replica holds (``in_use``) and nobody asked for in
        ``UNUSED_COPY_TTL_S`` (a copy asked for is touched), nor is being downloaded."""
        fetching = {cached_copy(self.cache_dir, name, identity) for name, identity in self._fetches}
        oldest = time.time_ns() - int(UNUSED_COPY_TTL_S * 1e9)
        for folder in _entries(self.cache_dir):
            if folder not in in_use and folder not in fetching and _modified_ns(folder) < oldest:
                _remove(folder)


def _linked(published: Path, cache_dir: Path, name: str) -> Path:
    """A link in the cache to a local store's folder, named for the publish it holds."""
    link = cached_copy(cache_dir, name, identity_of_folder(published))
    if link.is_symlink() and link.readlink() == published:
        _touch(link)
        return link
    link.parent.mkdir(parents=True, exist_ok=True)
    temporary = link.with_name(f".{link.name}.{time.time_ns()}.link")
    temporary.symlink_to(published)
    os.replace(temporary, link)
    return link


def _entries(cache_dir: Path) -> list[Path]:
    """The copies and links in a cache (``<name>@<identity>``; names hold '/', so at any depth)."""
    found = []
    for folder, subfolders, files in os.walk(cache_dir):  # never into a link: the store's folders
        for entry in subfolders + files:
            path = Path(folder) / entry
            if "@" in entry and not entry.startswith(".") and (path.is_symlink() or (path / CONFIG_FILE).is_file()):
                found.append(path)
        subfolders[:] = [entry for entry in subfolders if "@" not in entry]
    return found


def _remove(entry: Path) -> None:
    """A copy, or a link to a local store's folder (never what it points at)."""
    if entry.is_symlink():
        with contextlib.suppress(FileNotFoundError):
            entry.unlink()
    else:
        shutil.rmtree(entry, ignore_errors=True)


def _touch(entry: Path) -> None:
    with contextlib.suppress(OSError):
        os.utime(entry, follow_symlinks=False)  # a link's own time: the store's folder is not ours


def _modified_ns(entry: Path) -> int:
    try:
        return entry.lstat().st_mtime_ns
    except OSError:
        return 0  # gone already


def check_adapter(name: str, folder: Path, max_rank: int) -> None:
    """Refuse, with a clear error, what vLLM would refuse with a stack trace."""
    config_path = folder / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise api_errors.adapter_invalid(name, f"{CONFIG_FILE} is missing") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise api_errors.adapter_invalid(name, f"{CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise api_errors.adapter_invalid(name, f"{CONFIG_FILE} is not a JSON object")
    if not (folder / WEIGHTS_FILE).is_file():
        raise api_errors.adapter_invalid(name, f"{WEIGHTS_FILE} is missing")
    raw_ranks = [config.get("r")] + list((config.get("rank_pattern") or {}).values())
    ranks = [rank for rank in raw_ranks if isinstance(rank, int) and rank > 0]
    if len(ranks) < len(raw_ranks):
        raise api_errors.adapter_invalid(name, f"{CONFIG_FILE} has no valid LoRA rank 'r'")
    if max(ranks) > max_rank:
        raise api_errors.adapter_rank_too_large(name, max(ranks), max_rank)
