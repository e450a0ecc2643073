"""The pool's background loops (replica supervision, the check of held adapters against the store)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("inference.periodic")


async def every(interval_s: float, step: Callable[[], Awaitable[None]], what: str) -> None:
    """Run ``step`` now and every ``interval_s`` after, for ever. An error in one run is logged and
    the next run goes on: a loop that died would leave nothing to restart a crashed replica or
    unload a deleted adapter."""
    while True:
        try:
            await step()
        except Exception:
            log.exception("%s failed; trying again in %.0f s", what, interval_s)
        await asyncio.sleep(interval_s)
