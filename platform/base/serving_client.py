"""The platform's side of the serving backends (the embedded inference pool, and Ray Serve for the
catalog's models with ``backend = "ray"``): their connections, and what they say about themselves.
The gateway, the dashboard, the health checks and the workers use it.

Connections exist one set per event loop: completions go through ``core.http_client`` (the
hot path), the occasional metrics scrape through httpx. They belong to the loop that opened them: a
server runs one loop, tests may run several one after another. Every call presents the internal
token: the pool answers nothing without it. The pool's health document (``GET /health``) serves
/healthz and the models page.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from django.conf import settings

from core.catalog import BACKENDS
from core.http_client import HttpClient
from core.internal_token import bearer
from core.model_names import parse_model_name

HEALTH_TIMEOUT_S = 1.0
PRELOAD_TIMEOUT_S = 60.0  # an adapter load: well under a second locally, a download from S3 first
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


def backend_url(backend: str, path: str) -> str:
    """A backend's address: the embedded pool's, or the Ray Serve application's (``backend = "ray"``);
    both answer the same routes the same way."""
    root = settings.RAY_SERVE_URL if backend == "ray" else settings.INFERENCE_POOL_URL
    return f"{root.rstrip('/')}{path}"


def pool_url(path: str) -> str:
    return backend_url("embedded", path)


def serving_url(model: str, path: str) -> str:
    """Where a model's requests go: its base model's backend (a model not in the catalog: the pool's 404)."""
    base = settings.MODEL_CATALOG.get(parse_model_name(model).base_model_id)
    return backend_url(base.backend if base is not None else "embedded", path)


def pool_headers() -> dict[str, str]:
    return {"Authorization": bearer(settings.INTERNAL_TOKEN)}


class PoolUnavailable(Exception):
    """The pool did not answer, or not with its health document; the message says which."""


def pool_health() -> tuple[int, dict]:
    """The status code and body of the pool's health document."""
    return _health_document(pool_url("/health"))


def ray_health() -> tuple[int, dict]:
    """The same of the Ray Serve application (``inference.ray_serve``)."""
    return _health_document(backend_url("ray", "/health"))


def backends() -> set[str]:
    """The backends the catalog's models use: "embedded", "ray"."""
    return {model.backend for model in settings.MODEL_CATALOG.models}


def _health_document(url: str) -> tuple[int, dict]:
    try:
        response = httpx.get(url, headers=pool_headers(), timeout=HEALTH_TIMEOUT_S)
        return response.status_code, response.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise PoolUnavailable(f"{url}: {exc}") from None


class ServedModel(Protocol):
    """What ``Serving.of`` reads of a model (``finetuning.registry.UsableModel`` is one)."""

    @property
    def base_model_id(self) -> str: ...

    @property
    def served_as(self) -> str: ...


@dataclass(frozen=True)
class Serving:
    """What the backends' health documents say runs: each base model's state ("ready", "waking",
    "starting", "asleep", "cold"), and on how many ready replicas each model (base, or adapter revision) is
    loaded."""

    states: dict[str, str]
    loaded: Counter[str]

    @classmethod
    def from_health(cls, *bodies: dict) -> Serving:
        """From the health documents of the backends that answered (the pool's, Ray Serve's)."""
        states: dict[str, str] = {}
        loaded: Counter[str] = Counter()
        for body in bodies:
            states |= {model: state.get("state", "") for model, state in body.get("models", {}).items()}
            for replica in body.get("replicas", []):
                if replica.get("healthy"):
                    loaded.update([replica["model"], *replica.get("adapters", [])])
        return cls(states, loaded)

    def of(self, model: ServedModel) -> dict[str, Any] | None:
        """``{"state", "replicas"}``: "loaded" on N replicas; "ready" (a fine-tune whose base model
        runs: its adapter loads on its first request, in well under a second); "waking"; "starting";
        "asleep" (scaled to zero, its process kept: its next request wakes a replica, in a fraction
        of a second); "cold" (scaled to zero: its next request starts a replica and waits for it). None: its backend
        did not say."""
        replicas = self.loaded.get(model.served_as, 0)
        if replicas:
            return {"state": "loaded", "replicas": replicas}
        base = self.states.get(model.base_model_id)
        if base is None:
            return None
        return {"state": "ready" if base == "ready" else base, "replicas": 0}


def _health_urls() -> list[str]:
    """The health documents of the backends the catalog's models use."""
    used = backends()
    return [backend_url(backend, "/health") for backend in BACKENDS if backend in used]


def serving() -> Serving:
    """From the backends' health documents; PoolUnavailable when none answers."""
    bodies, problems = [], []
    for url in _health_urls():
        try:
            bodies.append(_health_document(url)[1])
        except PoolUnavailable as exc:
            problems.append(str(exc))
    if not bodies:
        raise PoolUnavailable("; ".join(problems))
    return Serving.from_health(*bodies)


async def serving_async() -> Serving | None:
    """As ``serving``, for an async view; None when no backend answers (the caller says "unknown")."""
    bodies = []
    for url in _health_urls():
        try:
            bodies.append((await pool_client().get(url, timeout=HEALTH_TIMEOUT_S)).json())
        except (httpx.HTTPError, ValueError):
            continue
    return Serving.from_health(*bodies) if bodies else None


def preload(model: str) -> int:
    """Have the pool load a just-published adapter where its requests will go; on how many
    replicas it is loaded now."""
    url = serving_url(model, "/v1/adapters/preload")
    try:
        response = httpx.post(url, json={"model": model}, headers=pool_headers(), timeout=PRELOAD_TIMEOUT_S)
        if response.status_code != 200:
            raise PoolUnavailable(_error_message(response))
        return int(response.json()["replicas"])
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        raise PoolUnavailable(f"{url}: {exc}") from None


def _error_message(response: httpx.Response) -> str:
    """The pool's own words for a refusal (its errors are OpenAI-shaped), else its status."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"{response.request.url} answered {response.status_code}"
