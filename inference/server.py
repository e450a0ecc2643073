"""The pool's HTTP face (internal: the gateway in front of it authenticates and authorizes callers).

Every route needs the internal token (``inference.internal_auth``); the pool presents the same
token to its replicas, on the admin client (probes, adapter loads, /v1/models) and the hot path.

- POST /v1/chat/completions, /v1/completions: route, load the adapter, relay (``completions``);
  the organization the request is for in ``ORGANIZATION_HEADER`` (``core.openai_protocol``), and
  background work (a batch's lines) marked by ``BACKGROUND_HEADER``
- POST /v1/adapters/preload {"model"}: load a just-published adapter where its requests will go
- GET /health: each model's state (ready, starting, cold) and its replicas'; 200 when one is
  ready or every model is cold (scaled to zero: it starts on its next request)
- GET /metrics: Prometheus text
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from core import api_errors, strict_json
from core.http_client import HttpClient, Poster
from core.internal_token import bearer
from core.openai_protocol import BACKGROUND_HEADER, ORGANIZATION_HEADER
from inference.adapters import AdapterManager
from inference.completions import CompletionsHandler
from inference.internal_auth import RequireInternalToken
from inference.metrics import CONTENT_TYPE, Metrics
from inference.pool import Pool


def admin_client(internal_token: str, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """For health probes, adapter loads and unloads (completions go through ``replica_client``)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=5.0, read=120.0, write=60.0, pool=60.0),
        headers={"Authorization": bearer(internal_token)},
        transport=transport,
    )


def replica_client(internal_token: str) -> HttpClient:
    """The hot path to the replicas."""
    return HttpClient(headers={"Authorization": bearer(internal_token)})


def create_app(pool: Pool, adapters: AdapterManager, http: Poster, metrics: Metrics, internal_token: str) -> Starlette:
    handler = CompletionsHandler(pool, pool.catalog, adapters, http, metrics)
    adapters.replicas = pool.replicas
    metrics.watch_replicas(lambda: pool.replicas)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        background = [
            asyncio.create_task(pool.supervise_forever(adapters.client)),
            asyncio.create_task(adapters.watch_forever()),
        ]
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await adapters.client.aclose()
            if hasattr(http, "aclose"):
                await http.aclose()
            pool.stop()

    async def answer(request: Request, endpoint: str) -> Response:
        headers = request.headers
        return await handler.handle(
            await request.body(), endpoint, headers.get(ORGANIZATION_HEADER), BACKGROUND_HEADER in headers
        )

    async def chat_completions(request: Request) -> Response:
        return await answer(request, "chat/completions")

    async def completions(request: Request) -> Response:
        return await answer(request, "completions")

    async def preload(request: Request) -> JSONResponse:
        try:
            model = strict_json.loads(await request.body())["model"]
        except (ValueError, KeyError, TypeError):
            raise api_errors.ApiError(
                'The body must be {"model": "<base_model_id>:<suffix>"}.', param="model"
            ) from None
        pinned, replicas = await handler.preload(str(model))
        return JSONResponse({"model": pinned, "replicas": replicas})

    async def health(request: Request) -> JSONResponse:
        body = pool.health()
        return JSONResponse(body, status_code=200 if body["serving"] else 503)

    async def prometheus(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def api_error(request: Request, exc: api_errors.ApiError) -> Response:
        return Response(exc.json_bytes(), exc.status, exc.headers(), media_type="application/json")

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/adapters/preload", preload, methods=["POST"]),
            Route("/health", health),
            Route("/metrics", prometheus),
        ],
        # Starlette types every handler as taking any Exception, though it calls this one only with an ApiError.
        exception_handlers={api_errors.ApiError: api_error},  # type: ignore[dict-item]
        middleware=[Middleware(RequireInternalToken, token=internal_token)],
        lifespan=lifespan,
    )
