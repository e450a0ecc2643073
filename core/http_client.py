"""A small HTTP/1.1 client for the hot path: gateway -> pool -> vLLM replica.

httpx costs about 1.4 ms a request on this project's 2-core machines (measured against a trivial
server: httpx 1.7-1.9 ms, aiohttp 0.7-0.8 ms, a plain keep-alive socket 0.3 ms), and a completion
crosses two such hops: most of the 5 ms the gateway may add. The hops are our own services on a
private network speaking plain HTTP/1.1, so this client only does what they need: POST a body,
read the status, headers and body (Content-Length or chunked, streamed as it arrives), and keep
connections alive for the next request (plain or TLS). httptools, uvicorn's parser, does the
parsing. Everything off the hot path (health checks, adapter loads, metrics) keeps using httpx.

A POST is never sent twice: once its bytes are written, whatever goes wrong is ``UpstreamBroken``
(it may have reached the server, and a generation must not run twice). Only a connection that
fails before anything is sent is ``UpstreamUnavailable``, safe to try elsewhere. To make "the
server closed the idle connection just as we reused it" rare enough to give up on, a connection
idle for ``REUSE_IDLE_S`` is not reused: uvicorn (vLLM's server, and ours) closes idle
connections after 5 s.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Protocol
from urllib.parse import urlsplit

import httptools

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 600.0  # between two reads: a long generation sends nothing until it is done
REUSE_IDLE_S = 2.0  # well inside uvicorn's 5 s keep-alive: the server has not closed it yet
_READ_SIZE = 1 << 16


_Key = tuple[str, str, int]  # scheme, host, port: one set of kept-alive connections each


class UpstreamError(Exception):
    pass


class UpstreamUnavailable(UpstreamError):
    """Nothing was sent: the connection could not be made. Safe to send the request elsewhere."""


class UpstreamBroken(UpstreamError):
    """The connection failed after the request was sent: it may have reached the server."""


class UpstreamTimeout(UpstreamError):
    pass


class UpstreamResponse(Protocol):
    status: int
    headers: dict[str, str]

    def iter_body(self) -> AsyncIterator[bytes]: ...
    async def read(self) -> bytes: ...
    def close(self) -> None: ...


class Poster(Protocol):
    """What the forwarding code needs from a client (tests give it a fake)."""

    async def post(
        self, url: str, body: bytes, content_type: str = "application/json", headers: dict[str, str] | None = None
    ) -> UpstreamResponse: ...


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.idle_since = time.monotonic()

    @property
    def usable(self) -> bool:
        fresh = time.monotonic() - self.idle_since < REUSE_IDLE_S
        return fresh and not self.writer.is_closing() and not self.reader.at_eof()

    def close(self) -> None:
        self.writer.close()


class Response:
    """One response, read incrementally from its connection; ``close`` gives the connection back."""

    def __init__(self, client: HttpClient, key: _Key, connection: _Connection):
        self._client, self._key = client, key
        self._connection: _Connection | None = connection  # None once given back or dropped
        self._parser = httptools.HttpResponseParser(self)
        self._chunks: deque[bytes] = deque()
        self._headers_done = self._complete = self._keep_alive = False
        self._received_any = False
        self.status = 0
        self.headers: dict[str, str] = {}

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self._headers_done = True

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        self._complete = True
        self._keep_alive = self._parser.should_keep_alive()  # only meaningful inside the callback

    async def _feed(self) -> None:
        assert self._connection is not None, "the body is read before the response is closed"
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                data = await self._connection.reader.read(_READ_SIZE)
        except TimeoutError:
            self._discard()
            raise UpstreamTimeout(f"no data from {self._key[1]}:{self._key[2]} in {READ_TIMEOUT_S:.0f} s") from None
        except OSError as exc:
            self._discard()
            raise UpstreamBroken(repr(exc)) from None
        if not data:
            self._discard()
            if self._received_any:
                raise UpstreamBroken("the connection closed in the middle of a response")
            raise UpstreamBroken("the connection closed after the request was sent, before any response")
        self._received_any = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._discard()
            raise UpstreamBroken(f"unreadable response: {exc}") from None

    async def _read_headers(self) -> None:
        while not self._headers_done:
            await self._feed()

    async def iter_body(self) -> AsyncIterator[bytes]:
        try:
            while True:
                while self._chunks:
                    yield self._chunks.popleft()
                if self._complete:
                    break
                await self._feed()
        finally:
            self.close()

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.iter_body()])

    def close(self) -> None:
        """Reuse the connection if the response was read to its end, else drop it."""
        if self._connection is None:
            return
        if self._complete and self._keep_alive:
            self._client._release(self._key, self._connection)
            self._connection = None
        else:
            self._discard()

    def _discard(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


def _header_lines(headers: dict[str, str]) -> str:
    if any(char in name + value for name, value in headers.items() for char in "\r\n"):
        raise ValueError("a header name or value contains a line break")  # it would forge headers
    return "".join(f"{name}: {value}\r\n" for name, value in headers.items())


class HttpClient:
    """Keep-alive connections per host; ``post`` returns once the response headers are in."""

    def __init__(self, max_idle_per_host: int = 256, headers: dict[str, str] | None = None):
        """``headers``: sent with every request (the internal token: every destination of one
        client is the same kind of service), formatted once here rather than per request."""
        self.max_idle_per_host = max_idle_per_host
        self._extra_headers = _header_lines(headers or {})
        self._tls = ssl.create_default_context()  # for https:// pools and remote replicas
        self._idle: dict[_Key, deque[_Connection]] = {}

    async def post(
        self, url: str, body: bytes, content_type: str = "application/json", headers: dict[str, str] | None = None
    ) -> Response:
        """``headers``: this request's own, beside the client's."""
        parts = urlsplit(url)
        key = (parts.scheme, parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80))
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        own = _header_lines(headers) if headers else ""
        request = (
            f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: keep-alive\r\n{self._extra_headers}{own}\r\n"
        ).encode("latin-1") + body
        connection = self._idle_connection(key) or await self._connect(key)
        response = Response(self, key, connection)
        try:
            connection.writer.write(request)
            await connection.writer.drain()
            await response._read_headers()
        except OSError as exc:
            response._discard()
            raise UpstreamBroken(f"sending to {key[1]}:{key[2]} failed ({exc!r})") from None
        return response

    def _idle_connection(self, key: _Key) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()  # the most recently used: least likely to have been closed
            if connection.usable:
                return connection
            connection.close()
        return None

    async def _connect(self, key: _Key) -> _Connection:
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(
                    key[1], key[2], ssl=self._tls if key[0] == "https" else None
                )
        except (OSError, TimeoutError) as exc:
            raise UpstreamUnavailable(f"cannot connect to {key[1]}:{key[2]} ({exc!r})") from None
        return _Connection(reader, writer)

    def _release(self, key: _Key, connection: _Connection) -> None:
        idle = self._idle.setdefault(key, deque())
        if len(idle) < self.max_idle_per_host and not connection.writer.is_closing():
            connection.idle_since = time.monotonic()
            idle.append(connection)
        else:
            connection.close()

    async def aclose(self) -> None:
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
