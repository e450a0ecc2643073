"""Background work yields to live requests on a replica, on the embedded pool and on Ray Serve alike.

Background work is what nobody reads token by token: a batch's lines, an evaluation's answers, the
publish gate's (the gateway marks it with ``BACKGROUND_HEADER``). While live requests are in flight on
a replica, or were this recently (``LIVE_QUIET_S``: the gap between one client's requests), only
``BACKGROUND_BESIDE_LIVE`` background requests run there at once, so a live request shares each
decode step with few of them; otherwise as many as come. Each replica, the pool's
(``inference.replica.Replica``) and Ray Serve's, counts its requests in a ``BackgroundTurns``.
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


@dataclass
class BackgroundTurns:
    """One replica's requests in flight, for the rule above. On one event loop: not thread-safe."""

    # Called once for each background request that waits for its turn (a replica's counter of them).
    waited: Callable[[], None] = field(default=lambda: None)
    inflight: int = 0
    background_inflight: int = 0  # of ``inflight``: background work's
    live_seen_at: float = float("-inf")  # when a live request last began or ended (time.monotonic())

    def may_start(self, background: bool) -> bool:
        """Whether a request may start now: a live one always; a background one unless live requests
        are in flight or were ``LIVE_QUIET_S`` ago and ``BACKGROUND_BESIDE_LIVE`` background ones run."""
        if not background:
            return True
        live_near = self.inflight > self.background_inflight or time.monotonic() - self.live_seen_at < LIVE_QUIET_S
        return not live_near or self.background_inflight < BACKGROUND_BESIDE_LIVE

    @asynccontextmanager
    async def turn(self, background: bool) -> AsyncIterator[None]:
        """Wait for the request's turn (a live one's is now), and count it in flight until the block ends."""
        if not self.may_start(background):
            self.waited()
            while not self.may_start(background):
                await asyncio.sleep(BACKGROUND_POLL_S)
        self.begin(background)
        try:
            yield
        finally:
            self.end(background)

    def begin(self, background: bool) -> None:
        self._count(background, 1)

    def end(self, background: bool) -> None:
        self._count(background, -1)

    def _count(self, background: bool, change: int) -> None:
        self.inflight += change
        if background:
            self.background_inflight += change
        else:
            self.live_seen_at = time.monotonic()
