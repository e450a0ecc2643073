"""The hot path's small HTTP/1.1 client, against tiny servers that answer exactly as told."""

from __future__ import annotations

import asyncio

import pytest

from core import http_client
from core.http_client import HttpClient, UpstreamBroken, UpstreamUnavailable

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class TinyServer:
    """Answers each request on a connection with the next of ``answers`` (raw bytes; None: read the
    request, then close the connection without a word, as a replica killed mid-request)."""

    def __init__(self, answers: list[bytes], close_after_each: bool = False):
        self.answers, self.close_after_each = list(answers), close_after_each
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self._answer(reader, writer)
        except (asyncio.CancelledError, ConnectionError, asyncio.IncompleteReadError):
            pass  # the test is over, or the client went away: nothing to report from a test server
        writer.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while self.answers:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(
                next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
            )
            self.requests.append(head + await reader.readexactly(length))
            answer = self.answers.pop(0)
            if answer is None:
                break
            for piece in answer if isinstance(answer, list) else [answer]:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.01)
            if self.close_after_each:
                break

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()


def _ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


async def test_it_posts_and_reads_a_body_reusing_one_connection():
    server = TinyServer([_ok(b'{"n": 1}'), _ok(b'{"n": 2}')])
    async with server as url:
        client = HttpClient()
        first = await client.post(f"{url}/v1/completions", b'{"model": "m"}')
        assert first.status == 200 and first.headers["content-type"] == "application/json"
        assert await first.read() == b'{"n": 1}'
        assert await (await client.post(f"{url}/v1/completions", b"{}")).read() == b'{"n": 2}'
        assert server.connections == 1
        assert server.requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert server.requests[0].endswith(b'\r\n\r\n{"model": "m"}')
        await client.aclose()


async def test_it_sends_its_headers_with_every_request_and_refuses_a_line_break_in_them():
    server = TinyServer([_ok(b"{}"), _ok(b"{}")])
    async with server as url:
        client = HttpClient(headers={"Authorization": "Bearer internal"})
        for _ in range(2):
            await (await client.post(f"{url}/v1/completions", b"{}")).read()
        assert all(b"\r\nAuthorization: Bearer internal\r\n" in request for request in server.requests)
        await client.aclose()
    with pytest.raises(ValueError, match="line break"):
        HttpClient(headers={"Authorization": "Bearer x\r\nX-Forged: yes"})


async def test_it_streams_a_chunked_body_as_it_arrives():
    events = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]
    chunked = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"]
    chunked += [b"%x\r\n%s\r\n" % (len(event), event) for event in events] + [b"0\r\n\r\n"]
    async with TinyServer([chunked]) as url:
        response = await HttpClient().post(f"{url}/v1/chat/completions", b"{}")
        assert response.headers["content-type"] == "text/event-stream"
        assert [chunk async for chunk in response.iter_body()] == events


async def test_it_retries_on_a_fresh_connection_when_the_idle_one_was_closed():
    server = TinyServer([_ok(b"1"), _ok(b"2")], close_after_each=True)
    async with server as url:
        client = HttpClient()
        assert await (await client.post(url + "/", b"")).read() == b"1"
        await asyncio.sleep(0.05)  # the server has closed the kept-alive connection meanwhile
        assert await (await client.post(url + "/", b"")).read() == b"2"
        assert server.connections == 2


async def test_it_tells_nothing_listening_from_a_response_cut_short():
    async with TinyServer([]) as url:
        pass  # closed: nothing listens there now
    with pytest.raises(UpstreamUnavailable):
        await HttpClient().post(url + "/", b"")
    cut = [b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n", b"only part of it"]
    async with TinyServer([cut], close_after_each=True) as url:
        response = await HttpClient().post(url + "/", b"")
        with pytest.raises(UpstreamBroken):
            await response.read()


async def test_it_never_sends_a_post_twice_when_a_kept_alive_connection_dies_after_sending():
    server = TinyServer([_ok(b"1"), None])
    async with server as url:
        client = HttpClient()
        assert await (await client.post(url + "/", b"first")).read() == b"1"
        with pytest.raises(UpstreamBroken, match="after the request was sent"):
            await client.post(url + "/", b"second")
        await asyncio.sleep(0.05)
        assert [request.rpartition(b"\r\n\r\n")[2] for request in server.requests] == [b"first", b"second"]
        assert server.connections == 1  # no fresh connection carried it a second time


async def test_it_never_sends_a_post_twice_when_a_fresh_connection_dies_after_sending():
    server = TinyServer([None])
    async with server as url:
        with pytest.raises(UpstreamBroken):
            await HttpClient().post(url + "/", b"only once")
        await asyncio.sleep(0.05)
        assert len(server.requests) == 1 and server.connections == 1


async def test_it_does_not_reuse_a_connection_the_server_may_be_closing(monkeypatch):
    monkeypatch.setattr(http_client, "REUSE_IDLE_S", 0.05)
    server = TinyServer([_ok(b"1"), _ok(b"2")])
    async with server as url:
        client = HttpClient()
        assert await (await client.post(url + "/", b"")).read() == b"1"
        await asyncio.sleep(0.1)  # idle past the reuse limit: a server's keep-alive may be ending
        assert await (await client.post(url + "/", b"")).read() == b"2"
        assert server.connections == 2
