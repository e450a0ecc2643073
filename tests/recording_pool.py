"""The web application as ``server/asgi.py`` builds it (the body limits outermost), through both of
the gateway's entry points, in front of a stand-in pool that records the bodies it receives; and
the requests the tests send it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import httpx
import pytest

from core.config import Limit
from tests.inference_fixtures import BASE


class RecordingPool:
    """Answers every completion with ``{}`` and keeps the bodies it was sent, and their headers
    (names in lower case)."""

    def __init__(self):
        self.bodies: list[bytes] = []
        self.headers: list[dict[str, str]] = []

    async def answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                lines = head.lower().split("\r\n")
                length = next(int(line.split(":")[1]) for line in lines if line.startswith("content-length"))
                self.headers.append(dict(line.partition(":")[::2] for line in lines[1:] if line))
                self.headers[-1] = {name: value.strip() for name, value in self.headers[-1].items()}
                self.bodies.append(await reader.readexactly(length))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()  # the client closed its keep-alive connection


@contextlib.asynccontextmanager
async def stand_in_pool(settings, answering):
    """``answering.answer`` serves as the inference pool for the test."""
    server = await asyncio.start_server(answering.answer, "127.0.0.1", 0)
    settings.INFERENCE_POOL_URL = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield answering
    finally:
        server.close()


@pytest.fixture
async def pool(settings):
    async with stand_in_pool(settings, RecordingPool()) as recording:
        yield recording


@pytest.fixture(params=["fast path", "django views"])
def web(request, pool):
    from django.core.asgi import get_asgi_application
    from gateway.asgi import with_fast_path
    from server.body_limits import with_body_limits

    application = get_asgi_application()
    if request.param == "fast path":
        application = with_fast_path(application)
    application = with_body_limits(application)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://testserver")


def _limits(settings, **caps: int) -> None:
    """Lower some of ``settings.CONFIG.request_limits`` for one test (``caps``: field name -> value)."""
    limits = settings.CONFIG.request_limits
    lowered = {name: Limit(value, getattr(limits, name).setting) for name, value in caps.items()}
    settings.CONFIG = dataclasses.replace(settings.CONFIG, request_limits=dataclasses.replace(limits, **lowered))


def _bearer(persona) -> dict:
    return {"Authorization": f"Bearer {persona.key}"}


def _user(content) -> list[dict]:
    return [{"role": "user", "content": content}]


def _chat(**fields) -> dict:
    return {"model": BASE, "messages": _user("hi"), **fields}


def _error(response: httpx.Response) -> dict:
    return response.json()["error"]
