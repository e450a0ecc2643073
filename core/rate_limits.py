"""Fixed-window counters in Redis: how many requests a key, an organization or an address made in
the current window, checked and charged in one round trip.

A Lua script first checks every counter a request is subject to, then charges all of them only if
none would overflow (each by its own cost: 1 for a request, the estimated tokens for a token rate): a request refused by its organization's limit does not use up its key's allowance,
and two processes cannot both take the last slot (Redis runs a script alone). A counter lives
until its window ends (PEXPIRE at the first charge); its time to live is the ``Retry-After``.

Fixed windows allow a burst of up to twice a limit across a window's edge; that is the price of one
counter per limit instead of a log of timestamps, and fine for keeping tenants from starving each
other.

Redis down: the limits are not enforced and a warning is logged (once a minute): the platform's
availability must not depend on a counter that only protects fairness. Completions do not need
Redis otherwise, and uploads keep their storage quota, which the database enforces.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio
import redis.commands.core

from core.api_errors import ApiError

log = logging.getLogger(__name__)

KEY_PREFIX = "limits:"  # every counter's Redis key starts with this (tests use a prefix of their own)
RATE_LIMIT_TYPE = "requests"  # OpenAI's error type for a request-rate limit
TOKEN_LIMIT_TYPE = "tokens"  # and for a token-rate limit
RATE_LIMIT_CODE = "rate_limit_exceeded"  # OpenAI's code for both
_TIMEOUT_S = 0.5  # a Redis that does not answer costs a request at most this, then the limit is skipped
_WARN_EVERY_S = 60.0

# KEYS: the counters. ARGV: cost, limit and window (ms) of each counter in turn.
# Returns {0, 0} when charged, else {the first full counter's place (from 1), ms until its window ends}.
_CHECK_AND_CHARGE = """
for i, key in ipairs(KEYS) do
  local used = tonumber(redis.call('GET', key) or '0')
  if used + tonumber(ARGV[3 * i - 2]) > tonumber(ARGV[3 * i - 1]) then
    local ttl = redis.call('PTTL', key)
    if ttl < 0 then ttl = tonumber(ARGV[3 * i]) end
    return {i, ttl}
  end
end
for i, key in ipairs(KEYS) do
  local cost = tonumber(ARGV[3 * i - 2])
  if redis.call('INCRBY', key, cost) == cost then
    redis.call('PEXPIRE', key, ARGV[3 * i])
  end
end
return {0, 0}
"""


@dataclass(frozen=True)
class Limit:
    counter: str  # what is counted, e.g. "completions:key:42"
    limit: int  # at most this many in a window
    window_s: int
    describe: str  # for the refusal: "600 requests per minute for this API key"
    setting: str  # the variable that sets it, so the message says what an operator can raise
    cost: int = 1  # what one charge counts: a request, or its estimated tokens
    unit: str = RATE_LIMIT_TYPE  # what is counted, as OpenAI's error type names it


@dataclass(frozen=True)
class Exceeded:
    limit: Limit
    retry_after_s: int

    def error(self, param: str | None = None) -> ApiError:
        """OpenAI's shape for a rate limit: 429, type ``requests`` or ``tokens``, code ``rate_limit_exceeded``."""
        return ApiError(
            f"Rate limit reached: {self.limit.describe} ({self.limit.setting}). "
            f"Try again in {self.retry_after_s} s.",
            status=429, type=self.limit.unit, param=param, code=RATE_LIMIT_CODE, retry_after_s=self.retry_after_s,
        )


def _arguments(limits: Sequence[Limit]) -> tuple[list[str], list[int]]:
    keys = [KEY_PREFIX + limit.counter for limit in limits]
    argv: list[int] = []
    for limit in limits:
        argv += [limit.cost, limit.limit, limit.window_s * 1000]
    return keys, argv


def _refusal(limits: Sequence[Limit], answer: list[int]) -> Exceeded | None:
    place, wait_ms = (int(value) for value in answer)
    if place == 0:
        return None
    return Exceeded(limits[place - 1], max(1, math.ceil(wait_ms / 1000)))


_last_warning = 0.0


def _warn_unavailable(exc: Exception) -> None:
    global _last_warning
    now = time.monotonic()
    if now - _last_warning >= _WARN_EVERY_S:
        _last_warning = now
        log.warning("rate limits are not enforced: Redis does not answer (%s)", exc)


_sync_clients: dict[str, redis.Redis] = {}
_sync_scripts: dict[str, redis.commands.core.Script] = {}
# An asyncio client's connections belong to the loop that opened them (a server runs one loop,
# tests may run several one after another), as in base.serving_client.
_async_scripts: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, redis.commands.core.AsyncScript]] = (
    weakref.WeakKeyDictionary()
)
# Keyword arguments of both clients' from_url, whose other keywords are not floats: a dict of floats would not fit.
_CLIENT_OPTIONS: dict[str, Any] = {"socket_timeout": _TIMEOUT_S, "socket_connect_timeout": _TIMEOUT_S}


def _sync_redis(url: str) -> redis.Redis:
    client = _sync_clients.get(url)
    if client is None:
        client = _sync_clients[url] = redis.Redis.from_url(url, **_CLIENT_OPTIONS)
    return client


def _sync_script(url: str) -> redis.commands.core.Script:
    """The script on a client of ``url``: run by its digest (EVALSHA), sent whole only the first time."""
    script = _sync_scripts.get(url)
    if script is None:
        script = _sync_scripts[url] = _sync_redis(url).register_script(_CHECK_AND_CHARGE)
    return script


def _async_script(url: str) -> redis.commands.core.AsyncScript:
    scripts = _async_scripts.setdefault(asyncio.get_running_loop(), {})
    script = scripts.get(url)
    if script is None:
        client = redis.asyncio.Redis.from_url(url, **_CLIENT_OPTIONS)
        script = scripts[url] = client.register_script(_CHECK_AND_CHARGE)
    return script


def charge(redis_url: str, limits: Sequence[Limit]) -> Exceeded | None:
    """Count each limit's cost against it, or nothing when one would overflow (then: which, and
    when to retry). None also when Redis does not answer (logged): the request goes ahead."""
    keys, argv = _arguments(limits)
    try:
        answer = _sync_script(redis_url)(keys=keys, args=argv)
    except redis.RedisError as exc:
        _warn_unavailable(exc)
        return None
    return _refusal(limits, answer)


async def charge_async(redis_url: str, limits: Sequence[Limit]) -> Exceeded | None:
    """``charge`` for an event loop (the gateway), with no thread hop."""
    keys, argv = _arguments(limits)
    try:
        answer = await _async_script(redis_url)(keys=keys, args=argv)
    except redis.RedisError as exc:
        _warn_unavailable(exc)
        return None
    return _refusal(limits, answer)


# Only counters that still exist: one whose window ended meanwhile must not come back negative
# and without an expiry.
_REFUND = """
for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then redis.call('DECRBY', key, ARGV[i]) end
end
"""


def refund(redis_url: str, limits: Sequence[Limit]) -> None:
    """Give back what ``charge`` took, for something that turned out not to count (a successful
    sign-in is not a failure)."""
    try:
        counters = [KEY_PREFIX + limit.counter for limit in limits]
        _sync_redis(redis_url).eval(_REFUND, len(limits), *counters, *(limit.cost for limit in limits))
    except redis.RedisError as exc:
        _warn_unavailable(exc)


def reset(redis_url: str, limits: Sequence[Limit]) -> None:
    """Start the limits' windows over (a successful sign-in clears its username's failures)."""
    try:
        _sync_redis(redis_url).delete(*(KEY_PREFIX + limit.counter for limit in limits))
    except redis.RedisError as exc:
        _warn_unavailable(exc)
