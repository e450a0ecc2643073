"""The gateway's connection to the inference pool: one kept-alive client per event loop."""

from __future__ import annotations

import asyncio
import weakref

import httpx
from django.conf import settings

_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = weakref.WeakKeyDictionary()


def pool_client() -> httpx.AsyncClient:
    # A client's connections belong to the loop that opened them; a server runs one loop, tests
    # may run several one after another.
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        client = _clients[loop] = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=5.0, read=600.0, write=60.0, pool=60.0),
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=200),
        )
    return client


def pool_url(path: str) -> str:
    return f"{settings.INFERENCE_POOL_URL.rstrip('/')}{path}"
