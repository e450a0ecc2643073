"""Which adapters one replica holds, least recently used first: bookkeeping only, no I/O.

At most ``max_num_adapters_per_replica``, with one exception: an adapter is never unloaded while
the replica is still answering requests with it (nor for ``UNLOAD_GRACE_S`` after the last one).
Mixes its kernel computes from their parts (``weightless``: a manifest, no weights of their own)
are held beside them, up to as many again: a new one makes room only among them, so a flood of
mixes never sends an adapter with weights back to the store.
vLLM tells adapters apart *by name* when it puts a batch together (``LoRARequest.__eq__``): the
same name loaded again under a new id while the old id still has requests in the batch drops one
of them from the batch's adapter set, and the engine dies (``KeyError`` in ``convert_mapping``).
So a replica can hold a few adapters more than its capacity for a moment, and is trimmed as soon
as they are idle.

Fair use among organizations (``FairUse``, set in the catalog's ``lora_config``): each adapter
counts against the organization whose requests use it (the gateway names it to the pool). One
organization holds at most ``FairUse.mixes`` distinct mixes on a replica: past that, its own least
recently used idle mix goes. When room is needed, adapters go from the organizations over their
share (``FairUse.share`` adapters while another organization holds some there too), the one that
holds the most first, then by least recent use; so an organization over its share makes room from
its own (or from another over its share), never from one within it. When nothing that may go for
it is idle, nothing goes (``OwnAdaptersBusy``): its request waits for one to finish, or is refused.
Likewise for vLLM's batch slots (``max_loras``, ``batch_turn``): while another organization's
adapter requests are under way or waiting, one organization's distinct adapters under way stay
within ``FairUse.batch_share``. Requests that name no organization are never held back.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from core.adapter_store import identity_of_folder
from core.catalog import LoraConfig
from inference.adapter_mix import is_mix_name

UNLOAD_GRACE_S = 1.0  # after an adapter's last request: time for the engine to drop it from its batch
TURN_POLL_S = 0.05  # how often a request waiting for its batch turn (or its own room) looks again
# How long a load waits for an adapter of its organization's own to finish answering, when that
# organization is over a cap (a few unload graces: a steady stream of its requests frees one in time).
OWN_ROOM_WAIT_S = 5.0


@dataclass(frozen=True)
class HeldAdapter:
    version: str  # the publish it was loaded from (``AdapterVersion.identity``); a mix's digest
    folder: Path


@dataclass(frozen=True)
class FairUse:
    """How much of one replica's adapters one organization may hold (see the module docstring)."""

    share: int  # adapters, when room is needed while another organization holds some (capacity: no limit)
    mixes: int  # distinct mixes, always
    # distinct adapters answering at once (vLLM's batch slots, ``max_loras``) while another
    # organization's answer or wait; None: no limit
    batch_share: int | None = None

    @classmethod
    def of(cls, lora: LoraConfig, max_loras: int) -> FairUse:
        """``max_loras``: the replica's batch slots (``inference.replica.vllm_command``)."""
        if lora.organization_share >= 1:
            return cls(lora.max_num_adapters_per_replica, lora.max_mixes_per_organization)
        share = int(lora.max_num_adapters_per_replica * lora.organization_share)
        batch_share = int(max_loras * lora.organization_share)
        return cls(max(1, share), lora.max_mixes_per_organization, max(1, batch_share))


class OwnAdaptersBusy(Exception):
    """An organization is over one of its caps and every adapter that may make room is answering."""

    def __init__(self, mixes: bool, limit: int):
        super().__init__(f"over its {limit} {'mixes' if mixes else 'adapters'}, none idle")
        self.mixes, self.limit = mixes, limit


Victim = tuple[str, str]  # an adapter to unload, and why: "lru" (room), "organization_mixes" (its cap)


def fits_batch_slots(needs: tuple[str, ...], under_way: Iterable[tuple[str, ...]], slots: int) -> bool:
    """Whether vLLM's ``slots`` batch slots hold the adapters a request ``needs`` beside those of the
    requests under way (each one's: a kernel mix's parts, else its adapter). vLLM counts each
    request's own adapter against ``max_loras`` and keeps them within it itself; a kernel mix of
    several parts needs all their slots, which vLLM cannot count: while one runs or asks, they are
    counted here."""
    under_way = list(under_way)
    if len(needs) == 1 and all(len(adapters) == 1 for adapters in under_way):
        return True
    return len({*needs, *(adapter for adapters in under_way for adapter in adapters)}) <= slots


class AdapterSlots:
    """Which adapters one replica holds, least recently used first. Bookkeeping only: no I/O."""

    def __init__(self, capacity: int, fair_use: FairUse | None = None):
        self.capacity = capacity
        self.fair_use = fair_use or FairUse(share=capacity, mixes=capacity)  # None: no organization is held back
        self.held: OrderedDict[str, HeldAdapter] = OrderedDict()
        self.loading: set[str] = set()
        self.waiting: set[str] = set()  # loads waiting for their organization's own room: none is made for them
        # The organization whose requests use each adapter held or loading (None: not named, the
        # pool's own preloads and internal callers, never held back).
        self.owner: dict[str, str] = {}
        # Mixes whose replica computes them in its kernel (``inference.engine.mixes``): a manifest of
        # their parts, no weights of their own. They have a capacity of their own (as many as the
        # adapters), count in the shares, but not in an organization's mixes (``FairUse.mixes``
        # caps the combined adapters built for mixes).
        self.weightless: set[str] = set()
        self.turn_waiting: Counter[str] = Counter()  # organizations' requests waiting for a batch slot (``batch_turn``)
        self.running: Counter[str] = Counter()  # requests the engine is answering, per adapter
        self.last_finished: dict[str, float] = {}
        self.trim_scheduled = False
        self._locks: dict[str, asyncio.Lock] = {}

    def version(self, name: str) -> str | None:
        held = self.held.get(name)
        return held.version if held else None

    def holds(self, name: str) -> bool:
        return name in self.held or name in self.loading

    def touch(self, name: str, organization: str | None = None) -> None:
        self.held.move_to_end(name)
        if organization is not None:
            self.owner[name] = organization

    def start_loading(self, name: str, organization: str | None) -> None:
        self.loading.add(name)
        if organization is not None:
            self.owner[name] = organization

    def stop_loading(self, name: str) -> None:
        self.loading.discard(name)
        if name not in self.held:
            self.owner.pop(name, None)
            self.weightless.discard(name)

    def lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def add(self, name: str, held: HeldAdapter) -> None:
        self.held[name] = held
        self.held.move_to_end(name)

    def forget(self, name: str) -> HeldAdapter | None:
        if name not in self.loading:  # a load replacing it keeps its organization (and its kind)
            self.owner.pop(name, None)
            self.weightless.discard(name)
        return self.held.pop(name, None)

    def read_back(self, loaded: dict[str, Path]) -> None:
        """What the engine says it holds (name -> folder) replaces what we thought; order is kept."""
        for name in [name for name, held in self.held.items() if loaded.get(name) != held.folder]:
            self.forget(name)
        for name, folder in loaded.items():
            if name not in self.held:
                self.held[name] = HeldAdapter(identity_of_folder(folder), folder)

    def clear(self) -> None:
        """The replica's engine exited: whatever it held is gone."""
        self.held.clear()
        self.owner = {name: owner for name, owner in self.owner.items() if name in self.loading}
        self.weightless &= self.loading
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
        return any(self._excess(weightless, self.held) > 0 for weightless in (False, True))

    def victims(self, count_loading: bool = True) -> list[str]:
        """Idle adapters to evict to get back within capacity: of organizations over their share
        first, then least recently used.

        Before a load, adapters being loaded count too (room is made ahead); after one, only held
        adapters do. Busy adapters are never chosen: the replica may overshoot until they idle.
        """
        counted = [*self.held, *self._loads_counted()] if count_loading else self.held
        chosen = [
            victim
            for weightless in (False, True)
            for victim in self._fair_victims(self._excess(weightless, counted), set(), time.monotonic(), weightless)
        ]
        for name in chosen:
            self.forget(name)  # at once, so a concurrent load does not pick the same one
        return chosen

    def room_for(self, name: str) -> list[Victim]:
        """The adapters to evict before loading ``name`` (in ``loading``, its organization in
        ``owner``), each with its reason, taken out of ``held`` at once. Raises ``OwnAdaptersBusy``,
        taking nothing, when its organization is over a cap and none of the adapters that may make
        room for it is idle."""
        organization, now = self.owner.get(name), time.monotonic()
        chosen: list[Victim] = []
        if organization is not None and self._built_mix(name):
            mixes = [live for live in self._live() if self.owner.get(live) == organization and self._built_mix(live)]
            excess = len(mixes) - self.fair_use.mixes
            idle = [held for held in self._idle(now) if self.owner.get(held) == organization and self._built_mix(held)]
            if excess > 0 and len(idle) < excess:
                raise OwnAdaptersBusy(True, self.fair_use.mixes)
            chosen += [(held, "organization_mixes") for held in idle[: max(excess, 0)]]
        taken = {victim for victim, _ in chosen}
        weightless = name in self.weightless  # room among its own kind (a built mix's victims are adapters too)
        excess = self._excess(weightless, self._live()) - len(taken)
        # Over its share, it makes room only from organizations over theirs (itself first when it
        # holds the most): never from one within its share.
        over_share = excess > 0 and self._over_share(organization, self._holdings(taken))
        victims = self._fair_victims(excess, taken, now, weightless, over_share_only=over_share)
        if over_share and not victims:
            raise OwnAdaptersBusy(False, self.fair_use.share)
        chosen += [(victim, "lru") for victim in victims]
        for victim, _ in chosen:
            self.forget(victim)
        return chosen

    async def make_room(self, name: str, refusal: Callable[[OwnAdaptersBusy], Exception]) -> list[Victim]:
        """``room_for``, waiting up to ``OWN_ROOM_WAIT_S`` for an adapter of its organization's own to
        finish answering when it must make room from those (no room is made for it meanwhile); then
        raises ``refusal(busy)``."""
        deadline = time.monotonic() + OWN_ROOM_WAIT_S
        while True:
            try:
                return self.room_for(name)
            except OwnAdaptersBusy as busy:
                if time.monotonic() >= deadline:
                    raise refusal(busy) from None
            self.waiting.add(name)
            try:
                await asyncio.sleep(TURN_POLL_S)
            finally:
                self.waiting.discard(name)

    async def trim(self, evict: Callable[[str], Awaitable[None]], alive: Callable[[], bool]) -> None:
        """Back to capacity once the adapters over it have no requests left (concurrent loads
        overshoot), ``evict`` taking each victim out of the engine, while ``alive()``. The caller sets
        ``trim_scheduled`` when it starts this; it is cleared at the end."""
        try:
            while self.over_capacity() and alive():
                victims = self.victims(count_loading=False)
                for victim in victims:
                    await evict(victim)
                if not victims:
                    await asyncio.sleep(UNLOAD_GRACE_S)  # all busy: look again in a moment
        finally:
            self.trim_scheduled = False

    def batch_turn(self, name: str, organization: str | None, under_way: Iterable[str]) -> bool:
        """Whether a request of ``organization`` for adapter ``name`` may start now, ``under_way``
        being the adapters with requests under way on the replica: not when that would make the
        organization's distinct adapters under way more than its batch share while another
        organization has adapter requests under way or waiting for a turn. When it may, ``name``
        counts as the organization's from now on (the caller starts the request before it yields)."""
        if organization is None or self.fair_use.batch_share is None:
            return True
        under_way = set(under_way)
        own = {adapter for adapter in under_way if self.owner.get(adapter) == organization}
        if name not in own and len(own) >= self.fair_use.batch_share:
            waiting = {org for org, count in self.turn_waiting.items() if count}
            if ({self.owner.get(adapter) for adapter in under_way} | waiting) - {organization, None}:
                return False
        self.owner.setdefault(name, organization)
        return True

    async def wait_for_turn(
        self, organization: str | None, may_start: Callable[[], bool], wait_s: float, refusal: Callable[[], Exception]
    ) -> None:
        """Return once ``may_start()`` (at once when it already may), counting the organization among
        those waiting for a batch turn meanwhile (``batch_turn`` gives way to them); raise ``refusal()``
        after ``wait_s``. The caller starts its request before it yields, so the next one counts it."""
        if may_start():
            return
        deadline = time.monotonic() + wait_s
        if organization is not None:
            self.turn_waiting[organization] += 1
        try:
            while True:
                await asyncio.sleep(TURN_POLL_S)
                if may_start():
                    return
                if time.monotonic() >= deadline:
                    raise refusal()
        finally:
            if organization is not None:
                self.turn_waiting[organization] -= 1
                if self.turn_waiting[organization] <= 0:
                    del self.turn_waiting[organization]

    def _built_mix(self, name: str) -> bool:
        return is_mix_name(name) and name not in self.weightless

    def _loads_counted(self) -> set[str]:
        """Loads that room is made for: not those waiting for their organization's own room."""
        return self.loading - self.waiting - self.held.keys()

    def _live(self) -> list[str]:
        return [*self.held, *self._loads_counted()]

    def _excess(self, weightless: bool, names: Iterable[str]) -> int:
        """How many of ``names`` of one kind (weightless mixes, or adapters with weights) are over
        the capacity, which each kind has whole."""
        return sum((name in self.weightless) == weightless for name in names) - self.capacity

    def _idle(self, now: float) -> list[str]:
        """Held adapters that may be evicted now, least recently used first."""
        return [name for name in self.held if name not in self.loading and self.idle(name, now)]

    def _holdings(self, leaving: set[str]) -> Counter[str | None]:
        return Counter(self.owner.get(name) for name in self._live() if name not in leaving)

    def _over_share(self, organization: str | None, holdings: Counter[str | None]) -> bool:
        """Over its share while another organization holds or is loading adapters here."""
        if organization is None or self.fair_use.share >= self.capacity:
            return False
        if holdings[organization] <= self.fair_use.share:
            return False
        present = {self.owner.get(name) for name in [*self.held, *self.loading]}
        return bool(present - {organization, None})

    def _fair_victims(
        self, excess: int, taken: set[str], now: float, weightless: bool, over_share_only: bool = False
    ) -> list[str]:
        """``excess`` idle adapters of one kind (``weightless`` mixes or not) not in ``taken``, one
        at a time: of the organization most over its share (the least recently used of the most
        held), else the least recently used of all unless ``over_share_only``. Fewer when too few
        are idle."""
        holdings = self._holdings(taken)
        candidates = [  # least recently used first
            name for name in self._idle(now) if name not in taken and (name in self.weightless) == weightless
        ]
        chosen: list[str] = []
        while len(chosen) < excess and candidates:
            over = [name for name in candidates if self._over_share(self.owner.get(name), holdings)]
            if over:
                victim = min(over, key=lambda name: -holdings[self.owner.get(name)])  # min() keeps the first of equals
            elif over_share_only:
                break
            else:
                victim = candidates[0]
            candidates.remove(victim)
            holdings[self.owner.get(victim)] -= 1
            chosen.append(victim)
        return chosen
