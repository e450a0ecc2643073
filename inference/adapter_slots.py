"""Which adapters one replica holds, least recently used first: bookkeeping only, no I/O.

At most ``max_num_adapters_per_replica``, with one exception: an adapter is never unloaded while
the replica is still answering requests with it (nor for ``UNLOAD_GRACE_S`` after the last one).
vLLM tells adapters apart *by name* when it puts a batch together (``LoRARequest.__eq__``): the
same name loaded again under a new id while the old id still has requests in the batch drops one
of them from the batch's adapter set, and the engine dies (``KeyError`` in ``convert_mapping``).
So a replica can hold a few adapters more than its capacity for a moment, and is trimmed as soon
as they are idle.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

from core.adapter_store import identity_of_folder

UNLOAD_GRACE_S = 1.0  # after an adapter's last request: time for the engine to drop it from its batch


@dataclass(frozen=True)
class HeldAdapter:
    version: str  # the publish it was loaded from (``AdapterVersion.identity``); a mix's digest
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

    def read_back(self, loaded: dict[str, Path]) -> None:
        """What the engine says it holds (name -> folder) replaces what we thought; order is kept."""
        for name in [name for name, held in self.held.items() if loaded.get(name) != held.folder]:
            del self.held[name]
        for name, folder in loaded.items():
            if name not in self.held:
                self.held[name] = HeldAdapter(identity_of_folder(folder), folder)

    def clear(self) -> None:
        """The replica's engine exited: whatever it held is gone."""
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

    def victims(self, count_loading: bool = True) -> list[str]:
        """Idle adapters to evict, least recently used first, to get back within capacity.

        Before a load, adapters being loaded count too (room is made ahead); after one, only held
        adapters do. Busy adapters are never chosen: the replica may overshoot until they idle.
        """
        excess = len(self.held) + (len(self.loading) if count_loading else 0) - self.capacity
        if excess <= 0:
            return []
        now = time.monotonic()
        chosen = [name for name in self.held if name not in self.loading and self.idle(name, now)]
        chosen = chosen[:excess]
        for name in chosen:
            del self.held[name]  # at once, so a concurrent load does not pick the same one
        return chosen
