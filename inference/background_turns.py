"""Background work yields to live requests on a replica, on the embedded pool and on Ray Serve alike.

Background work is what nobody reads token by token: a batch's lines, an evaluation's answers, the
publish gate's (the gateway marks it with ``BACKGROUND_HEADER``). While live requests are in flight on
a replica, or were this recently (``LIVE_QUIET_S``: the gap between one client's requests), only
``BACKGROUND_BESIDE_LIVE`` background requests run there at once, so a live request shares each
decode step with few of them; otherwise as many as come. The pool's replicas keep their counts in
``inference.replica.Replica``; Ray Serve's in a ``BackgroundTurns`` of their own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

BACKGROUND_BESIDE_LIVE = 1
LIVE_QUIET_S = 2.0
BACKGROUND_POLL_S = 0.05  # how often background work waiting for its turn looks again


def background_may_start(inflight: int, background_inflight: int, live_seen_at: float, now: float) -> bool:
    """Whether a background request may start on a replica with these requests in flight (all, and
    background ones) whose last live request began or ended at ``live_seen_at`` (time.monotonic())."""
    live_near = inflight > background_inflight or now - live_seen_at < LIVE_QUIET_S
    return not live_near or background_inflight < BACKGROUND_BESIDE_LIVE


@dataclass
class BackgroundTurns:
    """One replica's requests in flight, for the rule above. On one event loop: not thread-safe."""

    # Called once for each background request that waits for its turn (a replica's counter of them).
    waited: Callable[[], None] = field(default=lambda: None)
    inflight: int = 0
    background_inflight: int = 0
    live_seen_at: float = float("-inf")

    @asynccontextmanager
    async def turn(self, background: bool) -> AsyncIterator[None]:
        """Wait for the request's turn (a live one's is now), and count it in flight until the block ends."""
        if background and not self._may_start():
            self.waited()
            while not self._may_start():
                await asyncio.sleep(BACKGROUND_POLL_S)
        self._count(background, 1)
        try:
            yield
        finally:
            self._count(background, -1)

    def _may_start(self) -> bool:
        return background_may_start(self.inflight, self.background_inflight, self.live_seen_at, time.monotonic())

    def _count(self, background: bool, change: int) -> None:
        self.inflight += change
        if background:
            self.background_inflight += change
        else:
            self.live_seen_at = time.monotonic()
