"""The futures of the Tinker protocol, in Redis: a request is accepted at once with an id, done
later (by the run's trainer, or by the pool for a sample), and its result is fetched by id.

- ``loops:ops:<run>``: the run's requests in the order they came, for its trainer (a list);
- ``loops:owner:<request>``: the organization a request belongs to (another one's id is a 404);
- ``loops:result:<request>``: its result once done, kept REQUEST_TTL_S for the client's retries.

A result is ``{"kind", "value"}`` (``kind`` says how the web shapes it: ``forward_backward`` and
``sample`` go out as protobuf to an SDK that asks for it, the rest as JSON) or ``{"error",
"category"}`` (``user`` when the request was at fault, ``server`` otherwise).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any

import redis
import redis.asyncio
from django.conf import settings

REQUEST_TTL_S = 3600
POLL_WAIT_S = 20.0  # how long a retrieve waits for a result before answering "try again" (the SDK waits 45 s)
# A retrieve looks again soon at first (a step's result often comes within milliseconds), then less
# often, so a client's many futures waiting at once cost Redis little.
_FIRST_LOOK_S, _LAST_LOOK_S = 0.005, 0.05

FORWARD_BACKWARD, SAMPLE, JSON = "forward_backward", "sample", "json"


def ops_key(run_id: str) -> str:
    return f"loops:ops:{run_id}"


def _owner_key(request_id: str) -> str:
    return f"loops:owner:{request_id}"


def _result_key(request_id: str) -> str:
    return f"loops:result:{request_id}"


def new_request_id() -> str:
    return "req_" + secrets.token_hex(12)


def async_redis() -> redis.asyncio.Redis:
    return redis.asyncio.Redis.from_url(settings.CONFIG.redis_url, socket_timeout=POLL_WAIT_S + 10)


def sync_redis() -> redis.Redis:
    return redis.Redis.from_url(settings.CONFIG.redis_url, socket_timeout=30)


async def accept(organization_id: int, run_id: str | None = None, operation: dict[str, Any] | None = None) -> str:
    """A new request of the organization, its id returned; with ``run_id`` and ``operation``, queued
    for the run's trainer (after every request of the run accepted before it)."""
    request_id = new_request_id()
    client = async_redis()
    try:
        async with client.pipeline(transaction=True) as pipe:
            pipe.set(_owner_key(request_id), str(organization_id), ex=REQUEST_TTL_S)
            if run_id is not None and operation is not None:
                pipe.rpush(ops_key(run_id), json.dumps({"request_id": request_id, **operation}))
                pipe.expire(ops_key(run_id), REQUEST_TTL_S)
            await pipe.execute()
    finally:
        await client.aclose()
    return request_id


async def done_at_once(organization_id: int, value: dict[str, Any]) -> str:
    """A request the web answers itself (a run created, or created from a state): its id, its result there already."""
    request_id = await accept(organization_id)
    await finish_async(request_id, result(JSON, value))
    return request_id


def result(kind: str, value: Any) -> dict[str, Any]:
    return {"kind": kind, "value": value}


def failure(message: str, by_user: bool) -> dict[str, Any]:
    return {"error": message, "category": "user" if by_user else "server"}


def finish(client: redis.Redis, request_id: str, outcome: dict[str, Any]) -> None:
    """Record a request's outcome (from a worker)."""
    client.set(_result_key(request_id), json.dumps(outcome), ex=REQUEST_TTL_S)


async def finish_async(request_id: str, outcome: dict[str, Any]) -> None:
    client = async_redis()
    try:
        await client.set(_result_key(request_id), json.dumps(outcome), ex=REQUEST_TTL_S)
    finally:
        await client.aclose()


async def owner(request_id: str) -> int | None:
    client = async_redis()
    try:
        found = await client.get(_owner_key(request_id))
    finally:
        await client.aclose()
    return int(found) if found is not None else None


async def outcome(request_id: str, wait_s: float = POLL_WAIT_S) -> dict[str, Any] | None:
    """The request's outcome, waited for at most ``wait_s``; None while it is not done."""
    client = async_redis()
    deadline, pause = time.monotonic() + wait_s, _FIRST_LOOK_S
    try:
        while True:
            found = await client.get(_result_key(request_id))
            if found is not None:
                return dict(json.loads(found))
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(pause)
            pause = min(pause * 2, _LAST_LOOK_S)
    finally:
        await client.aclose()
