"""The adapters one Ray Serve replica's vLLM server holds, as the embedded pool's replicas hold theirs.

Ray routes a request by its multiplexed model id, which the ingress makes the pinned name and the
publish it answers with (``routing_id``: ``<base>:<suffix>@rN#<identity>``, ``AdapterVersion``): a
name deleted and published again (``r1`` again, maybe by another organization) is another model to
Ray, so no replica answers it with the deleted adapter's weights. vLLM holds it under the pinned
name (what the answer names); loading a new publish of a name replaces the old one, once its
requests are answered (vLLM tells adapters apart by name inside a batch, ``inference.adapter_slots``).

Which adapters stay is decided here, as on the pool (``AdapterSlots.make_room``): a full replica
unloads an idle adapter of the organization most over its share, never one of an organization within
its share, and an organization over its share makes room from its own. Ray's cache of multiplexed
ids remembers ``ROUTING_MEMORY`` times as many (so Ray's own least-recently-used eviction does not
decide), and serves for routing: a request Ray routes here for an adapter this replica unloaded loads
it again (``ensure``, on every request). An adapter leaves vLLM, and its cached copy the replica's
cache, when the replica makes room, when Ray forgets its id, and within ``RECHECK_HELD_S`` of its
deletion (``watch_forever``, as the pool's ``AdapterManager.retire_deleted``).
Loads and unloads are counted as the pool counts them, in the replica's ``Metrics`` (the one its
``AdapterSource`` counts downloads in), which it reports to the ingress's /metrics.

A mix (``inference.adapter_mix``) is computed in the kernel, as on the pool: its parts are held as
adapters, the mix as a manifest of them (``hold_mix``), which has no weights and a capacity of its
own (``AdapterSlots.weightless``: ``inference.engine.mixes``). A mix leaves with any of its parts.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections import Counter
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import httpx

from core import api_errors
from core.adapter_store import identity_of_folder
from inference.adapter_mix import Mix, manifest_folder, mix_folder
from inference.adapter_slots import AdapterSlots, FairUse, HeldAdapter
from inference.adapter_source import AdapterSource
from inference.adapters import NOT_THE_ADAPTERS_FAULT, RECHECK_HELD_S, _until_idle, _vllm_message, room_refusal
from inference.periodic import every

log = logging.getLogger("inference.ray_serve.replica_adapters")

ROUTING_MEMORY = 4  # Ray's cache of multiplexed ids holds this many times the replica's adapters

_SEPARATOR = "#"  # in no model name: suffixes are [A-Za-z0-9_-], base ids a catalog's


def routing_id(pinned: str, identity: str) -> str:
    """The multiplexed model id Ray routes a request for this publish of ``pinned`` by."""
    return f"{pinned}{_SEPARATOR}{identity}"


def served_name(multiplexed_id: str) -> str:
    """The name vLLM holds the adapter of a multiplexed model id under (and requests name)."""
    return multiplexed_id.rpartition(_SEPARATOR)[0] or multiplexed_id


def routed_identity(multiplexed_id: str) -> str:
    """The publish the ingress saw when it routed the request ("": an id without one)."""
    _, separator, identity = multiplexed_id.rpartition(_SEPARATOR)
    return identity if separator else ""


class ServedAdapter:
    """What the multiplexed loader returns. Ray awaits its ``__del__`` when it evicts the adapter
    (a coroutine function set on the instance, so garbage collection never calls it)."""

    def __init__(self, name: str, evicted: Any):
        self.name = name
        self.__del__ = evicted


class ReplicaAdapters:
    """Loads, unloads and retires one replica's adapters through its vLLM server's admin routes."""

    def __init__(
        self, source: AdapterSource, admin: httpx.AsyncClient, url: str, max_rank: int, capacity: int,
        fair_use: FairUse | None = None,
    ):
        """``fair_use``: the organizations' shares of the replica's adapters and of vLLM's batch slots."""
        self.source, self.admin, self.url, self.max_rank = source, admin, url, max_rank
        self.metrics, self.base_model_id = source.metrics, source.base_model_id
        # Held (by served name), requests running, a lock per name, whose each one is.
        self.slots = AdapterSlots(capacity, fair_use)
        self.mixes: dict[str, Mix] = {}  # the kernel mixes held or loading, by name
        # Ray's cache entries per publish held: an id Ray still had from before a deletion (its
        # ingress's answer is a second old) may stand for the publish a newer id loaded.
        self._entries: Counter[tuple[str, str]] = Counter()
        self._watcher: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()

    async def load(self, multiplexed_id: str, organization: str | None = None) -> ServedAdapter:
        """Ray's loader (for an id Ray's cache lacks): ``ensure``, and unload that publish when Ray
        forgets the id (unless another id stands for it)."""
        entry = await self.ensure(multiplexed_id, organization)
        self._entries[entry] += 1

        async def evicted() -> None:  # a coroutine function, which Ray awaits; the unload waits for the requests
            self._entries[entry] -= 1
            if self._entries[entry] <= 0:
                del self._entries[entry]
                self._spawn(self.unload(*entry, reason="lru"))

        return ServedAdapter(entry[0], evicted)

    async def ensure(self, multiplexed_id: str, organization: str | None) -> tuple[str, str]:
        """Make vLLM hold the publish the store has now for the id's name, making room fairly
        (``AdapterSlots.make_room``); the name and the publish held. Cheap when it is held."""
        name, routed = served_name(multiplexed_id), routed_identity(multiplexed_id)
        if self._watcher is None:  # started with the first adapter, in the replica's event loop
            self._watcher = asyncio.create_task(self.watch_forever())
        slots = self.slots
        if routed and slots.version(name) == routed:
            slots.touch(name, organization)
            return name, routed
        found = await self.source.version(name)
        if found is not None and routed and found.identity != routed:
            # The ingress saw another publish than this replica's answer from S3 (a second old): ask
            # S3 now, rather than answer with a publish the ingress did not route.
            found = await self.source.current_version(name)
        if found is None:
            raise api_errors.adapter_not_found(name)
        async with slots.lock(name):
            if slots.version(name) != found.identity:
                slots.start_loading(name, organization)
                try:
                    await self._install(name, await self._checked_folder(name, found.identity))
                finally:
                    slots.stop_loading(name)
            slots.touch(name, organization)
        return name, found.identity

    async def hold_mix(self, mix: Mix, organization: str | None) -> None:
        """Make vLLM hold the mix's manifest; its parts must be held already (``ensure``)."""
        slots = self.slots
        async with slots.lock(mix.name):
            if mix.name not in slots.held:
                slots.start_loading(mix.name, organization)
                slots.weightless.add(mix.name)
                self.mixes[mix.name] = mix
                try:
                    await self._install(mix.name, manifest_folder(self.source.cache_dir, mix))
                finally:
                    slots.stop_loading(mix.name)
                    if mix.name not in slots.held:
                        self.mixes.pop(mix.name, None)
            slots.touch(mix.name, organization)

    def slots_of(self, name: str) -> tuple[str, ...]:
        """The adapters a request for ``name`` needs in vLLM's batch slots: a mix's parts, or itself."""
        mix = self.mixes.get(name)
        return mix.part_names if mix is not None else (name,)

    async def _checked_folder(self, name: str, identity: str) -> Path:
        try:
            return await self.source.checked_folder(name, identity, self.max_rank)
        except api_errors.ApiError as exc:
            if exc.code not in NOT_THE_ADAPTERS_FAULT:
                self.metrics.adapter_loads.labels(self.base_model_id, "failed").inc()
            raise

    async def _install(self, name: str, folder: Path) -> None:
        """Load ``folder`` as ``name`` (in ``loading``), making room first (under ``name``'s lock)."""
        slots = self.slots
        if name in slots.held:  # another publish under this name: its requests end first
            await _until_idle(slots, name)
            slots.forget(name)
            await self._unload_now(name, "replaced")
        for victim, reason in await slots.make_room(name, lambda busy: room_refusal(self.base_model_id, busy)):
            await self._evict(victim, reason)
        started = time.perf_counter()
        response = await self._admin("load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
        if response.status_code == 400 and "already been loaded" in response.text:
            # vLLM kept it while we forgot (a retire that failed halfway): load it afresh.
            await self._admin("unload_lora_adapter", {"lora_name": name})
            response = await self._admin("load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
        if response.status_code != 200:
            self.metrics.adapter_loads.labels(self.base_model_id, "failed").inc()
            raise api_errors.adapter_invalid(name, _vllm_message(response))
        mix = self.mixes.get(name)
        slots.add(name, HeldAdapter(mix.digest if mix else identity_of_folder(folder), folder))
        if mix is None:
            self.source.prune_cache(name, self._held_folders(), newest=folder)
            self.metrics.adapter_loads.labels(self.base_model_id, "loaded").inc()
            self.metrics.adapter_load_seconds.labels(self.base_model_id).observe(time.perf_counter() - started)
        log.info("loaded %s in %.2f s", name, time.perf_counter() - started)
        if slots.over_capacity() and not slots.trim_scheduled:  # concurrent loads overshot: back once idle
            slots.trim_scheduled = True
            self._spawn(slots.trim(lambda victim: self._evict(victim, "lru"), lambda: True))

    async def _evict(self, victim: str, reason: str) -> None:
        """Unload an adapter the slots gave up (``room_for``, ``victims``), unless a request loaded it
        again meanwhile (under its lock: a request for it waits for the unload, then loads it afresh)."""
        async with self.slots.lock(victim):
            if victim not in self.slots.held:
                await self._unload_now(victim, reason)

    async def unload(self, name: str, identity: str, reason: str) -> None:
        """Unload this publish of ``name`` (or this mix), once its requests are answered; nothing when
        vLLM holds another publish under the name now, or Ray asked for it again."""
        slots = self.slots
        async with slots.lock(name):
            held = slots.held.get(name)
            if held is None or held.version != identity or (reason == "lru" and self._entries[(name, identity)]):
                return
            await _until_idle(slots, name)
            slots.forget(name)
            await self._unload_now(name, reason)

    async def _unload_now(self, name: str, reason: str) -> None:
        """Out of vLLM, with its cached copy (or a mix's manifest), and the mixes made of it."""
        mix = self.mixes.pop(name, None)
        try:
            await self._admin("unload_lora_adapter", {"lora_name": name})
        finally:
            if mix is not None:
                shutil.rmtree(mix_folder(self.source.cache_dir, mix, in_kernel=True), ignore_errors=True)
            else:
                if name not in self.slots.loading:  # a load replacing it prunes the older copies itself
                    self.source.prune_cache(name, self._held_folders())
                for other in [other for other in self.mixes.values() if name in other.part_names]:
                    self._spawn(self.unload(other.name, other.digest, "part_unloaded"))
        if mix is None:
            self.metrics.adapter_evictions.labels(self.base_model_id, reason).inc()
        log.info("unloaded %s (%s)", name, reason)

    async def watch_forever(self) -> None:
        await every(RECHECK_HELD_S, self.retire_deleted, "checking the held adapters against the store")

    async def retire_deleted(self) -> None:
        """Unload the held adapters the store no longer has (under its name, another publish is not
        it), without waiting for a request; then drop cached copies nobody uses. Mixes go with them."""
        for name, held in list(self.slots.held.items()):
            if name in self.mixes:
                continue
            try:
                found = await self.source.version(name)
            except api_errors.ApiError:  # the store cannot say (S3 down): keep it until it can
                continue
            if found is None or found.identity != held.version:
                self._spawn(self.unload(name, held.version, "deleted"))
        self.source.sweep_cache(self._held_folders())

    def _held_folders(self) -> set[Path]:
        return {held.folder for held in self.slots.held.values()}

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)  # a reference, so the task is not collected while it runs
        task.add_done_callback(self._background.discard)

    async def _admin(self, action: str, payload: dict) -> httpx.Response:
        return await self.admin.post(f"{self.url}/v1/{action}", json=payload)

    def stop(self) -> None:
        """Cancel the watcher and the unloads under way (from the replica's event loop)."""
        for task in [self._watcher, *self._background]:
            if task is not None:
                task.cancel()
