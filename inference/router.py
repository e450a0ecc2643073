"""Which replica answers a request: adapter affinity first, hot adapters spread, otherwise a stable choice.

For a fine-tuned model:
1. a replica that already holds the adapter (or is loading it) and is not busy: no load needed;
   among several, the least loaded;
2. when even that one has ``HOT_ADAPTER_INFLIGHT`` requests of this adapter in flight, the adapter is
   hot: the next replica in its rendezvous order that is less loaded takes the request, so a popular
   adapter ends up on more replicas while a quiet one stays on one;
3. otherwise the adapter's first non-busy replica in rendezvous (highest-random-weight) order: the
   same adapter keeps landing on the same replica, and when replicas come or go only the adapters
   of that replica move.
A base model request goes to the least loaded replica.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol, TypeVar

HOT_ADAPTER_INFLIGHT = 8  # this many requests of one adapter on a replica: spread it to another
BUSY_INFLIGHT = 64  # a replica with this many requests in flight takes new adapters only as a last resort


class Routable(Protocol):
    url: str

    @property
    def inflight(self) -> int: ...

    def inflight_for(self, model: str) -> int: ...
    def holds(self, adapter: str) -> bool: ...


# The caller gets back the kind of replica it passed in (a pool's Replica, or a test's stand-in).
R = TypeVar("R", bound=Routable)


def _weight(key: str, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\n{url}".encode(), digest_size=8).digest(), "big")


def rendezvous_order(key: str, replicas: Sequence[R]) -> list[R]:
    return sorted(replicas, key=lambda replica: _weight(key, replica.url), reverse=True)


def choose_replica(replicas: Sequence[R], model: str, adapter: bool) -> R | None:
    if not replicas:
        return None
    ranked = rendezvous_order(model, replicas)
    if not adapter:
        return min(ranked, key=lambda replica: replica.inflight)  # min() keeps the first of equals
    free = [replica for replica in ranked if replica.inflight < BUSY_INFLIGHT]
    holders = [replica for replica in free if replica.holds(model)]
    if holders:
        best = min(holders, key=lambda replica: replica.inflight)
        if best.inflight_for(model) < HOT_ADAPTER_INFLIGHT:
            return best
        spare = next((replica for replica in free if not replica.holds(model)), None)
        return spare if spare is not None and spare.inflight < best.inflight else best
    if free:
        return free[0]
    return min(ranked, key=lambda replica: replica.inflight)
