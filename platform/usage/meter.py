"""Completions usage, counted at the gateway as answers pass through it: every backend's answers
do, so none can skip the count.

A database write a request would cost more than the rest of the gateway's work (about 0.6 ms a
request), so counts gather in memory, per organization, API key, model and minute, and ``flush``
adds them to ``CompletionUsage`` rows. Under uvicorn, ``gateway.asgi`` runs ``flush_periodically``
for the process's lifetime and flushes once more when it stops. A process killed outright loses
at most ``FLUSH_EVERY_S`` of counts. A flush the database refuses keeps its counts for the next.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from datetime import datetime, timezone

from asgiref.sync import sync_to_async
from django.db import DatabaseError, IntegrityError, close_old_connections, transaction
from django.db.models import F

from usage.answers import Tokens
from usage.models import CompletionUsage

log = logging.getLogger(__name__)

FLUSH_EVERY_S = 5.0


@dataclass(frozen=True)
class Caller:
    """Whose completion it is, and of which model (the name asked for); ``batch``: a Batch API line's."""

    organization_id: int
    api_key_id: int | None
    model: str
    batch: bool = False


@dataclass
class _Counts:
    requests: int = 0
    prompt: int = 0
    completion: int = 0
    cached: int = 0

    def add(self, other: _Counts) -> None:
        self.requests += other.requests
        self.prompt += other.prompt
        self.completion += other.completion
        self.cached += other.cached


_Key = tuple[Caller, datetime]


class UsageMeter:
    def __init__(self) -> None:
        self._pending: dict[_Key, _Counts] = {}
        self._lock = threading.Lock()  # flush runs in a worker thread, record in the event loop

    def record(self, caller: Caller, tokens: Tokens, at: datetime | None = None) -> None:
        """One completion served: no I/O, for the request's hot path."""
        minute = (at or datetime.now(timezone.utc)).replace(second=0, microsecond=0)
        counts = _Counts(1, tokens.prompt, tokens.completion, tokens.cached)
        with self._lock:
            self._pending.setdefault((caller, minute), _Counts()).add(counts)

    def flush(self) -> int:
        """Add the counts gathered since the last flush to the database; how many rows it touched."""
        with self._lock:
            taken, self._pending = self._pending, {}
        items = list(taken.items())
        for index, ((caller, minute), counts) in enumerate(items):
            try:
                with transaction.atomic():
                    _add(caller, minute, counts)
            except IntegrityError:  # its organization or key was deleted since: nobody to bill
                log.info("usage of %s dropped: its organization or key is gone", caller)
            except DatabaseError:
                with self._lock:
                    for key, left in items[index:]:
                        self._pending.setdefault(key, _Counts()).add(left)
                raise
        return len(items)

    async def flush_periodically(self, every_s: float = FLUSH_EVERY_S) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.flush_async()
            except DatabaseError as exc:
                log.warning("usage not written yet (kept for the next flush): %s", exc)

    async def flush_async(self) -> None:
        """``flush`` from the event loop, in a worker thread that keeps its database connection."""
        await sync_to_async(self._flush_in_thread, thread_sensitive=False)()

    def _flush_in_thread(self) -> None:
        close_old_connections()  # as at a request's start: this thread's connection may be stale
        self.flush()


def _add(caller: Caller, minute: datetime, counts: _Counts) -> None:
    row = CompletionUsage.objects.filter(
        organization_id=caller.organization_id, api_key_id=caller.api_key_id, model=caller.model, batch=caller.batch,
        minute=minute,
    )
    added = row.update(
        requests=F("requests") + counts.requests,
        prompt_tokens=F("prompt_tokens") + counts.prompt,
        completion_tokens=F("completion_tokens") + counts.completion,
        cached_tokens=F("cached_tokens") + counts.cached,
    )
    if not added:
        CompletionUsage.objects.create(
            organization_id=caller.organization_id, api_key_id=caller.api_key_id, model=caller.model, batch=caller.batch,
            minute=minute, requests=counts.requests, prompt_tokens=counts.prompt, completion_tokens=counts.completion,
            cached_tokens=counts.cached,
        )


METER = UsageMeter()  # one per process: the gateway's
