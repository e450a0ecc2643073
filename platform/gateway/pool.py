"""The gateway's side of the inference pool: its connections, and what the pool says about itself.

Connections exist one set per event loop: completions go through ``inference.http_client`` (the
hot path), the occasional metrics scrape through httpx. They belong to the loop that opened them: a
server runs one loop, tests may run several one after another. Every call presents the internal
token: the pool answers nothing without it. The pool's health document (``GET /health``) serves
/healthz and the models page.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import Counter

import httpx
from django.conf import settings

from core.internal_token import bearer
from inference.http_client import HttpClient

HEALTH_TIMEOUT_S = 1.0
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


class PoolUnavailable(Exception):
    """The pool did not answer, or not with its health document; the message says which."""


def pool_health() -> tuple[int, dict]:
    """The status code and body of the pool's health document."""
    url = pool_url("/health")
    try:
        response = httpx.get(url, headers=pool_headers(), timeout=HEALTH_TIMEOUT_S)
        return response.status_code, response.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise PoolUnavailable(f"{url}: {exc}") from None


def replicas_serving() -> Counter[str]:
    """How many healthy replicas hold each model now: a base model on every replica of its own, a
    fine-tuned one where its adapter is loaded (it loads on its first request, in well under 2 s)."""
    _, body = pool_health()
    serving: Counter[str] = Counter()
    for replica in body.get("replicas", []):
        if replica.get("healthy"):
            serving.update([replica["model"], *replica.get("adapters", [])])
    return serving
