"""The gateway's connections to the inference pool, one set per event loop.

Completions go through ``inference.http_client`` (the hot path); the occasional metrics scrape
through httpx. Connections belong to the loop that opened them: a server runs one loop, tests may
run several one after another. Every call presents the internal token: the pool answers nothing
without it.
"""

from __future__ import annotations

import asyncio
import weakref

import httpx
from django.conf import settings

from core.internal_token import bearer
from inference.http_client import HttpClient

_fast: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, HttpClient] = weakref.WeakKeyDictionary()
_httpx: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = weakref.WeakKeyDictionary()


def pool_http() -> HttpClient:
    loop = asyncio.get_running_loop()
    client = _fast.get(loop)
    if client is None:
        client = _fast[loop] = HttpClient(headers=pool_headers())
    return client


def pool_client() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    client = _httpx.get(loop)
    if client is None:
        client = _httpx[loop] = httpx.AsyncClient(timeout=5.0, headers=pool_headers())
    return client


def pool_url(path: str) -> str:
    return f"{settings.INFERENCE_POOL_URL.rstrip('/')}{path}"


def pool_headers() -> dict[str, str]:
    return {"Authorization": bearer(settings.INTERNAL_TOKEN)}
