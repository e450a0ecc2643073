"""The pool's HTTP face: its health now; the routing gateway builds on it."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from inference.pool import Pool


def create_app(pool: Pool) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        supervisor = asyncio.create_task(pool.supervise_forever())
        try:
            yield
        finally:
            supervisor.cancel()
            pool.stop()

    async def health(request: Request) -> JSONResponse:
        body = pool.health()
        return JSONResponse(body, status_code=200 if body["ready_replicas"] else 503)

    return Starlette(routes=[Route("/health", health)], lifespan=lifespan)
