"""Making replicas hold the adapters their requests name.

``AdapterManager.pinned`` names the revision the store publishes for a fine-tuned model now
(``<name>@r<N>``), and ``AdapterManager.ensure`` runs before a request goes to a replica: it loads
that revision there through vLLM's ``/v1/load_lora_adapter`` (evicting the least recently used
idle one when the replica is full, see ``inference.adapter_slots``), and unloads it everywhere once
the store no longer has it. A new revision is a new adapter beside the old one, which leaves as any
idle adapter does. What a replica holds is known by publish (``AdapterVersion.identity``), not by
name: a name deleted and published again (``r1`` again, maybe by another organization) is loaded
afresh, from a folder of its own, never answered with the deleted adapter's weights. An adapter's
cached copy leaves the cache with the last replica that held it. (An adapter published before
revisions has a timestamp for a version; a republished one is reloaded in place, once its requests
are answered.) ``watch_forever`` looks at every held adapter every ``RECHECK_HELD_S``, so a deleted
one leaves the replicas (and the cache) within seconds, not at its next request; a request still
streaming with it finishes first.

``ensure_mix`` does the same for a mix (``inference.adapter_mix``). Where the replica's kernel
computes mixes (``inference.engine.mixes``), it loads the parts as adapters and the mix as a
manifest naming them with their scales: nothing is built, and any scale costs nothing. Elsewhere the
mix's combined adapter is built once from the parts' cached copies (``core.lora_algebra``). Either
is written to the adapter cache under the mix's digest, then loaded, counted in the replica's slots
and evicted like any other adapter (a manifest among the manifests, which have a capacity of their
own: ``inference.adapter_slots``). It is unloaded once a part is republished or deleted, and its
folder goes when no replica holds it. A kernel mix's parts count as the request's adapters while
it runs (``Replica``'s ``begin``/``end`` and the slots' ``started``/``finished``), so none is
evicted under it, and in vLLM's batch slots (``batch_turn``): the engine must find each in a slot.

Both take the organization the request is for (the gateway names it), and which adapter makes room
follows ``inference.adapter_slots.FairUse``: an organization over its cap of mixes, or over its
share of a replica while others use it, makes room from its own least recently used adapters. When
each of those is answering, its request waits up to ``adapter_slots.OWN_ROOM_WAIT_S`` for one to finish, then is
refused (429 ``adapter_slots_busy``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from core.adapter_store import identity_of_folder
from core import api_errors
from core.catalog import BaseModel
from core.model_names import pinned_name
from inference.adapter_mix import Mix, manifest_folder, mix_folder, published_mix, refuse_past_batch_slots
from inference.adapter_slots import AdapterSlots, HeldAdapter, OwnAdaptersBusy, Victim, fits_batch_slots
from inference.adapter_source import AdapterSource
from core.lora_algebra import CannotMix, Part, rank_of, write_combined
from inference.metrics import Metrics
from inference.periodic import every
from inference.replica import batch_slots

if TYPE_CHECKING:
    from inference.replica import Replica

log = logging.getLogger("inference.adapters")

VLLM_ADMIN_TIMEOUT_S = 60.0
RECHECK_HELD_S = 2.0
# How long a request waits for its organization's turn in the replica's batch slots (its own
# requests with other adapters finishing): a generation can take this long.
BATCH_TURN_WAIT_S = 30.0
# A copy that could not be had for these is no failed load in the metrics: the adapter is not at fault.
NOT_THE_ADAPTERS_FAULT = ("adapter_not_found", "adapter_store_unavailable")


class ReplicaUnavailable(Exception):
    """The replica did not answer: route the request elsewhere."""


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
        self.mixes: dict[str, Mix] = {}  # by name: the mixes loaded (or loading) on some replica
        self._builds: dict[str, asyncio.Task[Path]] = {}  # by digest: one build however many wait

    async def pinned(self, base_id: str, name: str) -> tuple[str, str]:
        """``name`` pinned to the revision the store publishes for it now
        (``core.model_names.pinned_name``), and that publish's identity, for ``ensure``."""
        found = await self.sources[base_id].version(name)
        if found is None:
            for held in self._held_revisions(name):  # deleted: its revisions leave every replica now
                self.retire_everywhere(held)
            raise api_errors.adapter_not_found(name)
        return pinned_name(name, found.version), found.identity

    def _held_revisions(self, name: str) -> set[str]:
        return {held for replica in self.replicas for held in replica.adapters.held if held.partition("@")[0] == name}

    async def ensure(
        self, replica: Replica, name: str, version: str | None = None, organization: str | None = None
    ) -> None:
        """``version``: the publish identity ``pinned`` just read for this name; None: read it from
        the store. ``organization``: whose request it is (None: not named)."""
        base = replica.model
        source = self.sources[base.id]
        if version is None:
            found = await source.version(name)
            version = found.identity if found else None
        if version is None:
            self.retire_everywhere(name)
            raise api_errors.adapter_not_found(name)
        slots = replica.adapters
        if slots.version(name) == version:
            slots.touch(name, organization)
            return
        async with slots.lock(name):
            if slots.version(name) == version:
                slots.touch(name, organization)
                return
            slots.start_loading(name, organization)
            try:
                await self._load_version(replica, name, version, source)
            finally:
                slots.stop_loading(name)

    def prefetch(self, base_id: str, name: str, version: str) -> None:
        """Fetch this version of an adapter into the local cache in the background while its
        request waits for a replica to start, so that the download overlaps the start instead of
        following it (``AdapterSource.folder``: the request's own load joins it). A failure is left
        to that load, which reports it."""
        source = self.sources[base_id]
        if not source.is_local:  # a local store's adapter is read where it lies
            self._spawn(_quietly(source.folder(name, version)))

    async def _load_version(self, replica: Replica, name: str, version: str, source: AdapterSource) -> None:
        folder = await self._checked_folder(replica.model, source, name, version)
        await self._install(replica, name, version, folder)
        source.prune_cache(name, self._held_folders(), newest=folder)

    async def _checked_folder(self, base: BaseModel, source: AdapterSource, name: str, version: str) -> Path:
        """A local copy of this publish of the adapter, checked as vLLM would check it."""
        try:
            return await source.checked_folder(name, version, base.lora.max_lora_rank)
        except api_errors.ApiError as exc:
            if exc.code not in NOT_THE_ADAPTERS_FAULT:
                self.metrics.adapter_loads.labels(base.id, "failed").inc()
            raise

    async def _install(self, replica: Replica, name: str, version: str, folder: Path) -> None:
        """Load ``folder`` as ``name`` on the replica, making room in its slots first."""
        slots = replica.adapters
        if name in slots.held:  # an older version, still answering requests maybe: let them finish
            await _until_idle(slots, name)
            slots.forget(name)
            await self._unload(replica, name, "replaced")
        for victim, reason in await self._room_for(replica, name):
            await self._evict(replica, victim, reason)
        await self._load(replica, name, folder)
        # The folder holds the publish actually fetched (the store may have moved on meanwhile).
        slots.add(name, HeldAdapter(identity_of_folder(folder) or version, folder))
        self._trim_when_idle(replica)

    async def _room_for(self, replica: Replica, name: str) -> list[Victim]:
        """What to evict before loading ``name`` (``AdapterSlots.make_room``)."""
        return await replica.adapters.make_room(name, lambda busy: room_refusal(replica.model.id, busy))

    async def batch_turn(self, replica: Replica, name: str, organization: str | None, mix: Mix | None = None) -> None:
        """Return when a request of ``organization`` for adapter ``name`` (or ``mix``) may start on
        the replica: at once, or once its adapters fit the engine's batch slots (``_fits_batch_slots``)
        and its organization's turn has come (``AdapterSlots.batch_turn``: some of its own requests
        with other adapters have finished); refused after ``BATCH_TURN_WAIT_S``. The caller starts
        the request before it yields (``Replica.begin``), so that the next one counts it."""
        slots = replica.adapters
        needs = mix.part_names if mix is not None and replica.mixes_in_kernel else (name,)
        refuse_past_batch_slots(needs, batch_slots(replica.model))

        def may_start() -> bool:
            return self._fits_batch_slots(replica, needs) and (
                organization is None or slots.batch_turn(name, organization, replica.inflight_by_model)
            )

        def refusal() -> Exception:
            return api_errors.adapter_slots_busy(
                replica.model.id, "batch", slots.fair_use.batch_share or batch_slots(replica.model)
            )

        await slots.wait_for_turn(organization, may_start, BATCH_TURN_WAIT_S, refusal)

    def _fits_batch_slots(self, replica: Replica, needs: tuple[str, ...]) -> bool:
        if not replica.mixes_in_kernel:
            return True  # built mixes are adapters of their own: vLLM counts them
        under_way = [self.slots_of(model) for model in replica.inflight_by_model if model != replica.model.id]
        return fits_batch_slots(needs, under_way, batch_slots(replica.model))

    def slots_of(self, name: str) -> tuple[str, ...]:
        """The adapters a request for ``name`` needs in vLLM's slots on a replica whose kernel computes
        mixes: a mix's parts, or the adapter itself."""
        mix = self.mixes.get(name)
        return mix.part_names if mix is not None else (name,)

    async def mix(self, base_id: str, scales: dict[str, float]) -> Mix:
        """The mix of these adapters (name -> scale, none 0) at their published versions."""
        return await published_mix(self.sources[base_id], base_id, scales)

    async def ensure_mix(
        self,
        replica: Replica,
        mix: Mix,
        organization: str | None = None,
        uses: Callable[[str], None] | None = None,
    ) -> None:
        """Make the replica hold the mix: its parts and its manifest where the kernel computes mixes,
        its combined adapter (built on first use) elsewhere. ``uses``: called with each part once it
        is held, with no pause between, so that the request counts it in use before anything could
        evict it (``AdapterSlots.started``)."""
        slots, name = replica.adapters, mix.name
        if replica.mixes_in_kernel:
            self.mixes[name] = mix
            for part in mix.parts:  # cheap when held; an evicted part is loaded again
                await self.ensure(replica, part.pinned, part.version, organization)
                if uses is not None:
                    uses(part.pinned)
        if name in slots.held:
            slots.touch(name, organization)
            return
        async with slots.lock(name):
            if name in slots.held:
                slots.touch(name, organization)
                return
            slots.start_loading(name, organization)
            self.mixes[name] = mix
            try:
                if replica.mixes_in_kernel:
                    slots.weightless.add(name)
                    folder = manifest_folder(self.sources[mix.base_id].cache_dir, mix)
                else:
                    folder = await self._combined_folder(replica.model, mix)
                await self._install(replica, name, mix.digest, folder)
            finally:
                slots.stop_loading(name)
                self._drop_unused_mix(name)  # a failed load leaves nothing behind

    async def _combined_folder(self, base: BaseModel, mix: Mix) -> Path:
        task = self._builds.get(mix.digest)
        if task is None:
            task = self._builds[mix.digest] = asyncio.create_task(self._build(base, mix))
            task.add_done_callback(lambda _: self._builds.pop(mix.digest, None))
        return await asyncio.shield(task)

    async def _build(self, base: BaseModel, mix: Mix) -> Path:
        source = self.sources[base.id]
        target = self._mix_folder(mix)
        if target.is_dir():
            return target
        folders = {part.name: await self._checked_folder(base, source, part.name, part.version) for part in mix.parts}
        ranks = {name: rank_of(folder) for name, folder in folders.items()}
        if sum(ranks.values()) > base.lora.max_lora_rank:
            raise api_errors.mix_rank_too_large(ranks, base.lora.max_lora_rank)
        parts = [Part(folders[part.name], part.scale) for part in mix.parts]
        started = time.perf_counter()
        try:
            await asyncio.to_thread(write_combined, parts, target)
        except CannotMix as exc:
            failed = next(name for name, folder in folders.items() if folder == exc.folder)
            raise api_errors.adapter_not_mixable(failed, str(exc)) from None
        log.info("built %s (rank %d) in %.2f s", mix.name, sum(ranks.values()), time.perf_counter() - started)
        return target

    def _mix_folder(self, mix: Mix, in_kernel: bool = False) -> Path:
        return mix_folder(self.sources[mix.base_id].cache_dir, mix, in_kernel)

    def _drop_unused_mix(self, name: str) -> None:
        """Forget a mix, and delete its folder, once no replica holds or loads it."""
        mix = self.mixes.get(name)
        if mix is None or any(replica.adapters.holds(name) for replica in self.replicas):
            return
        del self.mixes[name]
        shutil.rmtree(self._mix_folder(mix, in_kernel=True), ignore_errors=True)
        if mix.digest not in self._builds:
            shutil.rmtree(self._mix_folder(mix), ignore_errors=True)

    async def _mix_outdated(self, mix: Mix) -> bool:
        source = self.sources[mix.base_id]
        for part in mix.parts:
            found = await source.version(part.name)
            if found is None or found.identity != part.version:
                return True
        return False

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
        await replica.adapters.trim(lambda victim: self._evict(replica, victim, "lru"), lambda: replica.healthy)

    async def watch_forever(self) -> None:
        await every(RECHECK_HELD_S, self.retire_deleted, "checking the held adapters against the store")

    async def retire_deleted(self) -> None:
        """Unload, everywhere, the held adapters the store no longer has (under its name, a publish
        of another adapter is not it); then drop cached copies nobody uses."""
        held = {
            (replica.model.id, name, adapter.version)
            for replica in self.replicas
            for name, adapter in replica.adapters.held.items()
        }
        for base_id, name, identity in held:
            mix = self.mixes.get(name)
            try:
                if mix is not None:
                    deleted = await self._mix_outdated(mix)
                else:
                    found = await self.sources[base_id].version(name)
                    deleted = found is None or found.identity != identity
            except api_errors.ApiError:  # the store cannot say (S3 down): keep it until it can
                continue
            if deleted:
                self.retire_everywhere(name)
        in_use = self._held_folders()
        for source in {source.cache_dir: source for source in self.sources.values()}.values():
            source.sweep_cache(in_use)

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
                raise api_errors.ApiError(f"`{name}`: {message}", param="model", code="adapter_rank_too_large")
            if response.status_code == 404:
                message = f"the replica at {replica.url} cannot read {folder} ({message})"
            raise api_errors.adapter_invalid(name, message)
        self.metrics.adapter_loads.labels(replica.model.id, "loaded").inc()
        self.metrics.adapter_load_seconds.labels(replica.model.id).observe(time.perf_counter() - started)
        log.info("loaded %s on %s in %.2f s", name, replica.url, time.perf_counter() - started)

    async def _unload(self, replica: Replica, name: str, reason: str) -> None:
        try:
            await self._admin(replica, "unload_lora_adapter", {"lora_name": name})
        except ReplicaUnavailable:
            return  # a replica that is gone holds nothing
        finally:
            self._drop_unused_mix(name)
            self._drop_unused_copy(replica, name)
        self.metrics.adapter_evictions.labels(replica.model.id, reason).inc()
        log.info("unloaded %s from %s (%s)", name, replica.url, reason)

    def _drop_unused_copy(self, replica: Replica, name: str) -> None:
        """Delete the cached copies of an adapter once no replica holds or loads it (evicted,
        replaced or deleted): a copy is not kept for a later request, which fetches it again."""
        if name in self.mixes or any(other.adapters.holds(name) for other in self.replicas):
            return
        self.sources[replica.model.id].prune_cache(name, self._held_folders())

    def _held_folders(self) -> set[Path]:
        return {held.folder for replica in self.replicas for held in replica.adapters.held.values()}

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)  # a reference, so the task is not collected while it runs
        task.add_done_callback(self._background.discard)

    async def _admin(self, replica: Replica, action: str, payload: dict) -> httpx.Response:
        try:
            return await self.client.post(f"{replica.url}/v1/{action}", json=payload, timeout=VLLM_ADMIN_TIMEOUT_S)
        except httpx.TransportError as exc:
            raise ReplicaUnavailable(f"{replica.url}: {exc!r}") from exc


async def _quietly(work: Awaitable[object]) -> None:
    with contextlib.suppress(Exception):
        await work


def room_refusal(model_id: str, busy: OwnAdaptersBusy) -> api_errors.ApiError:
    """429: the organization is over its share or cap of mixes, and each of its own is answering."""
    return api_errors.adapter_slots_busy(model_id, "mixes" if busy.mixes else "share", busy.limit)


async def _until_idle(slots: AdapterSlots, name: str) -> None:
    while not slots.idle(name, time.monotonic()):
        await asyncio.sleep(0.05)
