"""The adapters one Ray Serve replica's vLLM server holds, as the embedded pool's replicas hold theirs.

Ray routes a request by its multiplexed model id, which the ingress makes the pinned name and the
publish it answers with (``routing_id``: ``<base>:<suffix>@rN#<identity>``, ``AdapterVersion``): a
name deleted and published again (``r1`` again, maybe by another organization) is another model to
Ray, so no replica answers it with the deleted adapter's weights. vLLM holds it under the pinned
name (what the answer names); loading a new publish of a name replaces the old one, once its
requests are answered (vLLM tells adapters apart by name inside a batch, ``inference.adapter_slots``).

An adapter leaves vLLM, and its cached copy the replica's cache, when Ray evicts it (the least
recently used past ``max_num_adapters_per_replica``) and within ``RECHECK_HELD_S`` of its deletion
(``watch_forever``, as the pool's ``AdapterManager.retire_deleted``), whether or not it is asked for.
Loads and unloads are counted as the pool counts them, in the replica's ``Metrics`` (the one its
``AdapterSource`` counts downloads in), which it reports to the ingress's /metrics.

A mix (``inference.adapter_mix``) is computed in the kernel, as on the pool: its parts are held as
adapters (Ray's multiplexed models, loaded by the replica before ``hold_mix``), the mix as a
manifest of them, which takes no slot and no memory (``inference.engine.mixes``). A mix leaves with
any of its parts, and the least recently used idle one past ``capacity`` mixes.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections import Counter, OrderedDict
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import httpx

from core import api_errors
from core.adapter_store import identity_of_folder
from inference.adapter_mix import Mix, manifest_folder, mix_folder
from inference.adapter_slots import AdapterSlots, FairUse, HeldAdapter
from inference.adapter_source import AdapterSource
from inference.adapters import NOT_THE_ADAPTERS_FAULT, RECHECK_HELD_S, _until_idle, _vllm_message
from inference.periodic import every

log = logging.getLogger("inference.ray_serve.replica_adapters")

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
        """``fair_use``: the organizations' shares of vLLM's batch slots (``AdapterSlots.batch_turn``;
        which adapter Ray evicts is Ray's least recently used)."""
        self.source, self.admin, self.url, self.max_rank = source, admin, url, max_rank
        self.metrics, self.base_model_id = source.metrics, source.base_model_id
        # Held (by served name), requests running, a lock per name, whose batch turn it is.
        self.slots = AdapterSlots(capacity, fair_use)
        # Ray's cache entries per publish held: an id Ray still had from before a deletion (its
        # ingress's answer is a second old) may stand for the publish a newer id loaded.
        self._entries: Counter[tuple[str, str]] = Counter()
        self.mixes: OrderedDict[str, Mix] = OrderedDict()  # the kernel mixes vLLM holds, least recently used first
        self._watcher: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()

    async def load(self, multiplexed_id: str) -> ServedAdapter:
        """Ray's loader: make vLLM hold the publish the store has now for the id's name."""
        name, routed = served_name(multiplexed_id), routed_identity(multiplexed_id)
        if self._watcher is None:  # started with the first adapter, in the replica's event loop
            self._watcher = asyncio.create_task(self.watch_forever())
        found = await self.source.version(name)
        if found is not None and routed and found.identity != routed:
            # The ingress saw another publish than this replica's answer from S3 (a second old): ask
            # S3 now. Ray keeps this id as loaded, so loading the old publish here would answer
            # every later request for it with the old weights.
            found = await self.source.current_version(name)
        if found is None:
            raise api_errors.adapter_not_found(name)
        async with self.slots.lock(name):
            held = self.slots.held.get(name)
            if held is None or held.version != found.identity:
                await self._install(name, await self._checked_folder(name, found.identity))
            entry = (name, self.slots.held[name].version)
            self._entries[entry] += 1

        async def evicted() -> None:  # a coroutine function, which Ray awaits; the unload waits for the requests
            self._entries[entry] -= 1
            if self._entries[entry] <= 0:
                del self._entries[entry]
                self._spawn(self.unload(*entry, reason="lru"))

        return ServedAdapter(name, evicted)

    async def hold_mix(self, mix: Mix) -> None:
        """Make vLLM hold the mix's manifest; its parts must be held already (``load``)."""
        async with self.slots.lock(mix.name):
            if mix.name in self.mixes:
                self.mixes.move_to_end(mix.name)
                return
            folder = manifest_folder(self.source.cache_dir, mix)
            response = await self._admin("load_lora_adapter", {"lora_name": mix.name, "lora_path": str(folder)})
            if response.status_code != 200 and "already been loaded" not in response.text:
                raise api_errors.adapter_invalid(mix.name, _vllm_message(response))
            self.mixes[mix.name] = mix
        idle = [name for name in self.mixes if not self.slots.running[name]]
        for name in idle[: len(self.mixes) - self.slots.capacity]:
            self._spawn(self.unload_mix(name, "lru"))

    def slots_of(self, name: str) -> tuple[str, ...]:
        """The adapters a request for ``name`` needs in vLLM's batch slots: a mix's parts, or itself."""
        mix = self.mixes.get(name)
        return mix.part_names if mix is not None else (name,)

    async def unload_mix(self, name: str, reason: str) -> None:
        """Unload a mix's manifest once its requests are answered, and delete its folder."""
        async with self.slots.lock(name):
            mix = self.mixes.get(name)
            if mix is None:
                return
            await _until_idle(self.slots, name)
            del self.mixes[name]
            try:
                await self._admin("unload_lora_adapter", {"lora_name": name})
            finally:
                shutil.rmtree(mix_folder(self.source.cache_dir, mix, in_kernel=True), ignore_errors=True)
        log.info("unloaded mix %s (%s)", name, reason)

    def _retire_mixes_of(self, part: str) -> None:
        """A part leaving takes the mixes made of it along (their manifests name it)."""
        for name, mix in list(self.mixes.items()):
            if part in mix.part_names:
                self._spawn(self.unload_mix(name, "part_unloaded"))

    async def _checked_folder(self, name: str, identity: str) -> Path:
        try:
            return await self.source.checked_folder(name, identity, self.max_rank)
        except api_errors.ApiError as exc:
            if exc.code not in NOT_THE_ADAPTERS_FAULT:
                self.metrics.adapter_loads.labels(self.base_model_id, "failed").inc()
            raise

    async def _install(self, name: str, folder: Path) -> None:
        if name in self.slots.held:  # another publish under this name: its requests end first
            await _until_idle(self.slots, name)
            self.slots.forget(name)
            self._retire_mixes_of(name)
            await self._admin("unload_lora_adapter", {"lora_name": name})
            self.metrics.adapter_evictions.labels(self.base_model_id, "replaced").inc()
        started = time.perf_counter()
        response = await self._admin("load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
        if response.status_code == 400 and "already been loaded" in response.text:
            # vLLM kept it while we forgot (a retire that failed halfway): load it afresh.
            await self._admin("unload_lora_adapter", {"lora_name": name})
            response = await self._admin("load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
        if response.status_code != 200:
            self.metrics.adapter_loads.labels(self.base_model_id, "failed").inc()
            raise api_errors.adapter_invalid(name, _vllm_message(response))
        self.slots.add(name, HeldAdapter(identity_of_folder(folder), folder))
        self.source.prune_cache(name, self._held_folders(), newest=folder)
        self.metrics.adapter_loads.labels(self.base_model_id, "loaded").inc()
        self.metrics.adapter_load_seconds.labels(self.base_model_id).observe(time.perf_counter() - started)
        log.info("loaded %s in %.2f s", name, time.perf_counter() - started)

    async def unload(self, name: str, identity: str, reason: str) -> None:
        """Unload this publish of ``name``, once its requests are answered, and drop its cached copy;
        nothing when vLLM holds another publish under the name now, or Ray asked for it again."""
        slots = self.slots
        async with slots.lock(name):
            held = slots.held.get(name)
            if held is None or held.version != identity or (reason == "lru" and self._entries[(name, identity)]):
                return
            await _until_idle(slots, name)
            slots.forget(name)
            self._retire_mixes_of(name)
            try:
                await self._admin("unload_lora_adapter", {"lora_name": name})
            finally:
                self.source.prune_cache(name, self._held_folders())
        self.metrics.adapter_evictions.labels(self.base_model_id, reason).inc()
        log.info("unloaded %s (%s)", name, reason)

    async def watch_forever(self) -> None:
        await every(RECHECK_HELD_S, self.retire_deleted, "checking the held adapters against the store")

    async def retire_deleted(self) -> None:
        """Unload the held adapters the store no longer has (under its name, another publish is not
        it), without waiting for a request; then drop cached copies nobody uses."""
        for name, held in list(self.slots.held.items()):
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
