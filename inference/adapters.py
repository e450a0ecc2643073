"""Adapters on replicas: where they come from, which replica holds which, loading and evicting them.

- ``AdapterSource``: one base model's dynamic LoRA path. It answers "which version is published
  now?" on every request (a local path is a few system calls; S3 a HEAD, remembered for a second),
  and gives a local folder for a version: the published folder itself, or an S3 copy synced into
  a cache, checksum-verified, downloaded once however many requests want it at the same moment.
  A missing adapter is never remembered: the next request looks again.
- ``AdapterSlots``: the adapters one replica holds, least recently used first, at most
  ``max_num_adapters_per_replica``.
- ``AdapterManager.ensure``: make a replica hold the published version of an adapter before a
  request goes there: load it through vLLM's ``/v1/load_lora_adapter`` (evicting the least recently
  used one when the replica is full), reload it when the store has a newer version, and unload it
  everywhere once the store no longer has it.

An adapter is never unloaded while the replica is still answering requests with it (nor for
``UNLOAD_GRACE_S`` after the last one): vLLM tells adapters apart *by name* when it puts a batch
together (``LoRARequest.__eq__``), so the same name loaded again under a new id while the old id
still has requests in the batch drops one of them from the batch's adapter set, and the engine
dies (``KeyError`` in ``convert_mapping``). A replica can therefore hold a few adapters more than
its capacity for a moment; it is trimmed as soon as they are idle.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from core.adapter_store import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterNotFound,
    AdapterStore,
    CorruptAdapter,
    LocalAdapterStore,
)
from inference import errors
from inference.metrics import Metrics

if TYPE_CHECKING:
    from inference.replica import Replica

log = logging.getLogger("inference.adapters")

REMOTE_VERSION_TTL_S = 1.0  # how long an S3 version answer is trusted (a found one; never a missing one)
UNLOAD_GRACE_S = 1.0  # after an adapter's last request: time for the engine to drop it from its batch
VLLM_ADMIN_TIMEOUT_S = 60.0


class ReplicaUnavailable(Exception):
    """The replica did not answer: route the request elsewhere."""


@dataclass(frozen=True)
class HeldAdapter:
    version: str
    folder: Path


class AdapterSlots:
    """Which adapters one replica holds, least recently used first. Bookkeeping only: no I/O."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.held: OrderedDict[str, HeldAdapter] = OrderedDict()
        self.loading: set[str] = set()
        self.running: Counter[str] = Counter()  # requests the engine is answering, per adapter
        self.last_finished: dict[str, float] = {}
        self.trim_scheduled = False
        self._locks: dict[str, asyncio.Lock] = {}

    def version(self, name: str) -> str | None:
        held = self.held.get(name)
        return held.version if held else None

    def holds(self, name: str) -> bool:
        return name in self.held or name in self.loading

    def touch(self, name: str) -> None:
        self.held.move_to_end(name)

    def lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def add(self, name: str, held: HeldAdapter) -> None:
        self.held[name] = held
        self.held.move_to_end(name)

    def forget(self, name: str) -> HeldAdapter | None:
        return self.held.pop(name, None)

    def clear(self) -> None:
        """The replica restarted or vanished: whatever it held is gone."""
        self.held.clear()
        self.running.clear()
        self.last_finished.clear()

    def started(self, name: str) -> None:
        self.running[name] += 1

    def finished(self, name: str) -> None:
        self.running[name] -= 1
        if self.running[name] <= 0:
            del self.running[name]
        self.last_finished[name] = time.monotonic()

    def idle(self, name: str, now: float) -> bool:
        """Safe to unload: no request of it at the engine, none for UNLOAD_GRACE_S."""
        return self.running[name] == 0 and now - self.last_finished.get(name, -UNLOAD_GRACE_S) >= UNLOAD_GRACE_S

    def over_capacity(self) -> bool:
        return len(self.held) > self.capacity

    def victims(self, keep: str | None = None, count_loading: bool = True) -> list[str]:
        """Idle adapters to evict, least recently used first, to get back within capacity.

        Before a load, adapters being loaded count too (room is made ahead); after one, only held
        adapters do. Busy adapters are never chosen: the replica may overshoot until they idle.
        """
        excess = len(self.held) + (len(self.loading) if count_loading else 0) - self.capacity
        if excess <= 0:
            return []
        now = time.monotonic()
        chosen = [name for name in self.held if name != keep and name not in self.loading and self.idle(name, now)]
        chosen = chosen[:excess]
        for name in chosen:
            del self.held[name]  # at once, so a concurrent load does not pick the same one
        return chosen


def _version_of_folder(folder: Path) -> str:
    # Published folders are named <name>@<version> by the store (local and S3 cache alike).
    return folder.name.rpartition("@")[2]


class AdapterSource:
    """One base model's dynamic LoRA path, as seen by the pool."""

    def __init__(self, store: AdapterStore, cache_dir: Path, metrics: Metrics, base_model_id: str):
        self.store, self.cache_dir, self.metrics, self.base_model_id = store, cache_dir, metrics, base_model_id
        self.is_local = isinstance(store, LocalAdapterStore)
        self._known: dict[str, tuple[str, float]] = {}  # S3: name -> (version, checked at)
        self._fetches: dict[tuple[str, str], asyncio.Task[Path]] = {}

    async def version(self, name: str) -> str | None:
        if self.is_local:
            found = self.store.version(name)  # a stat and a readlink: cheaper than a thread hop
            return found.version if found else None
        known = self._known.get(name)
        if known and time.monotonic() - known[1] < REMOTE_VERSION_TTL_S:
            return known[0]
        found = await asyncio.to_thread(self.store.version, name)
        if found is None:
            self._known.pop(name, None)
            return None
        self._known[name] = (found.version, time.monotonic())
        return found.version

    async def folder(self, name: str, version: str) -> Path:
        """A local folder holding this adapter; for S3 one download however many callers wait."""
        if self.is_local:
            return self.store.fetch(name, self.cache_dir)
        key = (name, version)
        task = self._fetches.get(key)
        if task is None:
            task = asyncio.create_task(self._download(name))
            self._fetches[key] = task
            task.add_done_callback(lambda _: self._fetches.pop(key, None))
        return await asyncio.shield(task)

    async def _download(self, name: str) -> Path:
        started = time.perf_counter()
        folder = await asyncio.to_thread(self.store.fetch, name, self.cache_dir)
        self.metrics.adapter_downloads.labels(self.base_model_id).inc()
        self.metrics.adapter_download_seconds.labels(self.base_model_id).observe(time.perf_counter() - started)
        return folder

    def prune_cache(self, name: str, in_use: set[Path], newest: Path | None = None) -> None:
        """Drop synced copies that no replica holds: older than ``newest``, or all when it is None."""
        if self.is_local:
            return
        prefix = self.cache_dir / name
        newest_at = newest.stat().st_mtime_ns if newest is not None else None
        for folder in prefix.parent.glob(f"{prefix.name}@*"):
            if folder in in_use or folder == newest:
                continue
            # A copy newer than the one just loaded may be about to load on another replica.
            if newest_at is None or folder.stat().st_mtime_ns < newest_at:
                shutil.rmtree(folder, ignore_errors=True)


def check_adapter(name: str, folder: Path, max_rank: int) -> None:
    """Refuse, with a clear error, what vLLM would refuse with a stack trace."""
    config_path = folder / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise errors.adapter_invalid(name, f"{CONFIG_FILE} is missing") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise errors.adapter_invalid(name, f"{CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise errors.adapter_invalid(name, f"{CONFIG_FILE} is not a JSON object")
    if not (folder / WEIGHTS_FILE).is_file():
        raise errors.adapter_invalid(name, f"{WEIGHTS_FILE} is missing")
    ranks = [config.get("r")] + list((config.get("rank_pattern") or {}).values())
    if not all(isinstance(rank, int) and rank > 0 for rank in ranks):
        raise errors.adapter_invalid(name, f"{CONFIG_FILE} has no valid LoRA rank 'r'")
    if max(ranks) > max_rank:
        raise errors.adapter_rank_too_large(name, max(ranks), max_rank)


def _vllm_message(response: httpx.Response) -> str:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:300]
    # vLLM wraps worker errors in "Call to add_lora method failed: Worker failed with error '...',
    # please check the stack trace above": keep the part a person can act on.
    inner = message.split("with error '", 1)[-1].split("', please check", 1)[0]
    return inner or message


class AdapterManager:
    """Makes replicas hold the adapters their requests name (see the module docstring)."""

    def __init__(self, sources: dict[str, AdapterSource], client: httpx.AsyncClient, metrics: Metrics):
        self.sources, self.client, self.metrics = sources, client, metrics
        self.replicas: Iterable[Replica] = ()  # set by the pool: every replica, to unload deleted adapters
        self._background: set[asyncio.Task] = set()
        self._retiring: set[tuple[str, str]] = set()

    async def ensure(self, replica: Replica, name: str) -> None:
        base = replica.model
        source = self.sources[base.id]
        version = await source.version(name)
        if version is None:
            self.retire_everywhere(name)
            raise errors.adapter_not_found(name)
        slots = replica.adapters
        if slots.version(name) == version:
            slots.touch(name)
            return
        async with slots.lock(name):
            if slots.version(name) == version:
                slots.touch(name)
                return
            slots.loading.add(name)
            try:
                await self._load_version(replica, name, version, source)
            finally:
                slots.loading.discard(name)

    async def _load_version(self, replica: Replica, name: str, version: str, source: AdapterSource) -> None:
        base = replica.model
        try:
            folder = await source.folder(name, version)
        except AdapterNotFound:
            raise errors.adapter_not_found(name) from None
        except CorruptAdapter as exc:
            self.metrics.adapter_loads.labels(base.id, "failed").inc()
            raise errors.adapter_invalid(name, f"its files do not match their checksums ({exc})") from None
        try:
            check_adapter(name, folder, base.lora.max_lora_rank)
        except errors.ApiError:
            self.metrics.adapter_loads.labels(base.id, "failed").inc()
            raise
        slots = replica.adapters
        if name in slots.held:  # an older version, still answering requests maybe: let them finish
            await _until_idle(slots, name)
            slots.forget(name)
            await self._unload(replica, name, "replaced")
        for victim in slots.victims():
            await self._evict(replica, victim, "lru")
        await self._load(replica, name, folder)
        # The folder names the version actually fetched (the store may have moved on meanwhile).
        slots.add(name, HeldAdapter(_version_of_folder(folder) or version, folder))
        self._trim_when_idle(replica)
        source.prune_cache(name, self._held_folders(), newest=folder)

    async def _evict(self, replica: Replica, victim: str, reason: str) -> None:
        # Under the victim's lock, so a request for it waits for the unload and then loads it afresh.
        async with replica.adapters.lock(victim):
            if victim in replica.adapters.held:
                return  # a request loaded it again meanwhile: it stays
            await self._unload(replica, victim, reason)

    def _trim_when_idle(self, replica: Replica) -> None:
        """Back to capacity once the adapters over it have no requests left (concurrent loads overshoot)."""
        slots = replica.adapters
        if slots.over_capacity() and not slots.trim_scheduled:
            slots.trim_scheduled = True
            self._spawn(self._trim(replica))

    async def _trim(self, replica: Replica) -> None:
        slots = replica.adapters
        try:
            while slots.over_capacity() and replica.healthy:
                victims = slots.victims(count_loading=False)
                for victim in victims:
                    await self._evict(replica, victim, "lru")
                if not victims:
                    await asyncio.sleep(UNLOAD_GRACE_S)  # all busy: look again in a moment
        finally:
            slots.trim_scheduled = False

    def retire_everywhere(self, name: str) -> None:
        """The store no longer has it: unload it from every replica, once its requests are answered."""
        for replica in self.replicas:
            key = (replica.url, name)
            if name in replica.adapters.held and key not in self._retiring:
                self._retiring.add(key)
                self._spawn(self._retire(replica, name, key))

    async def _retire(self, replica: Replica, name: str, key: tuple[str, str]) -> None:
        slots = replica.adapters
        try:
            async with slots.lock(name):
                await _until_idle(slots, name)
                if slots.forget(name) is not None:
                    await self._unload(replica, name, "deleted")
            self.sources[replica.model.id].prune_cache(name, self._held_folders())
        finally:
            self._retiring.discard(key)

    async def _load(self, replica: Replica, name: str, folder: Path) -> None:
        started = time.perf_counter()
        payload = {"lora_name": name, "lora_path": str(folder)}
        response = await self._admin(replica, "load_lora_adapter", payload)
        if response.status_code == 400 and "already been loaded" in response.text:
            # The replica kept it while we forgot (our bookkeeping was reset): load it afresh.
            await self._admin(replica, "unload_lora_adapter", {"lora_name": name})
            response = await self._admin(replica, "load_lora_adapter", payload)
        if response.status_code != 200:
            self.metrics.adapter_loads.labels(replica.model.id, "failed").inc()
            message = _vllm_message(response)
            if "greater than max_lora_rank" in message:
                raise errors.ApiError(400, f"`{name}`: {message}", param="model", code="adapter_rank_too_large")
            if response.status_code == 404:
                message = f"the replica at {replica.url} cannot read {folder} ({message})"
            raise errors.adapter_invalid(name, message)
        self.metrics.adapter_loads.labels(replica.model.id, "loaded").inc()
        self.metrics.adapter_load_seconds.labels(replica.model.id).observe(time.perf_counter() - started)
        log.info("loaded %s on %s in %.2f s", name, replica.url, time.perf_counter() - started)

    async def _unload(self, replica: Replica, name: str, reason: str) -> None:
        try:
            await self._admin(replica, "unload_lora_adapter", {"lora_name": name})
        except ReplicaUnavailable:
            return  # a replica that is gone holds nothing
        self.metrics.adapter_evictions.labels(replica.model.id, reason).inc()
        log.info("unloaded %s from %s (%s)", name, replica.url, reason)

    def _held_folders(self) -> set[Path]:
        return {held.folder for replica in self.replicas for held in replica.adapters.held.values()}

    def _spawn(self, work) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)  # a reference, so the task is not collected while it runs
        task.add_done_callback(self._background.discard)

    async def _admin(self, replica: Replica, action: str, payload: dict) -> httpx.Response:
        try:
            return await self.client.post(f"{replica.url}/v1/{action}", json=payload, timeout=VLLM_ADMIN_TIMEOUT_S)
        except httpx.TransportError as exc:
            raise ReplicaUnavailable(f"{replica.url}: {exc!r}") from exc


async def _until_idle(slots: AdapterSlots, name: str) -> None:
    while not slots.idle(name, time.monotonic()):
        await asyncio.sleep(0.05)
