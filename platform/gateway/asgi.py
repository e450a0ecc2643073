"""The fast path: the completion endpoints served in front of Django's request handling.

Django under ASGI runs each synchronous middleware step in a worker thread and sends its request
signals through threads too; for a proxy that adds one key lookup to a model call, that was most
of the gateway's cost (6-7 ms a request on a 2-core machine, against 0.6 ms this way).
``with_fast_path`` answers POST /v1/chat/completions, /v1/completions and /v1/responses itself, with
the same handlers the Django views use (``gateway.completions``, ``gateway.responses``: same key
check, same registry, same errors), and passes every other request to Django unchanged. Nothing these endpoints need is
lost: no session, cookie, CSRF or HTML response is involved, and the ORM is used the same way
(``gateway.access``).

``server/asgi.py`` wraps Django's application with it. Without that, the Django views in
``gateway.views`` serve the same endpoints (and still do under WSGI and Django's test client),
about 6 ms slower a request.

It also answers ASGI's lifespan messages (Django does not): for the process's lifetime it writes
the usage the gateway counts (``usage.meter``), and once more when the process stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from core.api_errors import ApiError, internal_error

log = logging.getLogger(__name__)

ENDPOINTS = {"/v1/chat/completions": "chat/completions", "/v1/completions": "completions", "/v1/responses": "responses"}


def with_fast_path(django_application: ASGIApp) -> ASGIApp:
    """Call with Django's ASGI application: the handler's imports need Django set up first."""
    from gateway import metrics as gateway_metrics
    from gateway.completions import STREAM_HEADERS, complete
    from gateway.responses import respond
    from core import api_errors

    async def answer(request: Request, endpoint: str) -> Response:
        authorization, body = request.headers.get("authorization"), await request.body()
        try:
            if endpoint == "responses":
                result = await respond(authorization, body)
            else:
                result = await complete(authorization, body, endpoint)
        except api_errors.ApiError as exc:
            return _error(exc)
        except Exception:  # a bug: the client gets the API's 500, the log gets the traceback
            log.exception("Internal Server Error: %s", request.url.path)
            return _error(internal_error())
        if result.stream is not None:
            return StreamingResponse(
                result.stream, status_code=result.status, media_type=result.content_type, headers=STREAM_HEADERS
            )
        return Response(result.body, result.status, result.headers, media_type=result.content_type)

    async def application(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        endpoint = ENDPOINTS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != "POST":
            await django_application(scope, receive, send)
            return
        response = await answer(Request(scope, receive), endpoint)
        gateway_metrics.REQUESTS.labels(endpoint, str(response.status_code)).inc()
        await response(scope, receive, send)

    return application


async def _lifespan(receive: Receive, send: Send) -> None:
    from usage.meter import METER

    flusher: asyncio.Task | None = None
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            flusher = asyncio.create_task(METER.flush_periodically())
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            if flusher is not None:
                flusher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await flusher
            try:
                await METER.flush_async()
            except Exception:  # the process stops anyway; say what is lost
                log.exception("usage counted since the last flush could not be written")
            await send({"type": "lifespan.shutdown.complete"})
            return


def _error(error: ApiError) -> Response:
    return Response(error.json_bytes(), error.status, error.headers(), media_type="application/json")
