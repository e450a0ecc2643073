"""The Responses API handler (``POST /v1/responses``), for the Django views and the ASGI fast path.

A Responses request is read and checked (``core.responses_protocol``), turned into the chat
completions request it means, and answered by ``gateway.completions.complete``: the key, the
organization's access to the model (and to each part of a mix), the request and tenant limits, the
pinned revision, the backend and the usage meter are chat's, unchanged. The chat completion that
comes back, whole or streamed, is turned into a Response; a refusal keeps its status and words, and
names the Responses field the caller sent (``max_output_tokens``, not ``max_tokens``).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from answering.forward import JSON, PoolAnswer
from core import api_errors
from core import responses_protocol as protocol
from gateway.access import authorize
from gateway.completions import bearer_key, complete

CHAT = "chat/completions"
EVENT_STREAM = "text/event-stream; charset=utf-8"


async def respond(authorization: str | None, body: bytes) -> PoolAnswer:
    """The Response to ``body``, whole or as a stream of events; refusals raise ``ApiError``."""
    raw_key = bearer_key(authorization)
    try:
        request = protocol.parse_request(body)
    except api_errors.ApiError:
        await authorize(raw_key, None)  # a bad key is a 401 even when the body is also wrong
        raise
    chat_body = json.dumps(protocol.chat_body(request)).encode()
    try:
        answer = await complete(authorization, chat_body, CHAT)
    except api_errors.ApiError as exc:
        raise protocol.in_responses_terms(exc) from None
    return as_response(request, answer, protocol.new_response_id())


def as_response(request: protocol.ResponsesRequest, answer: PoolAnswer, response_id: str) -> PoolAnswer:
    """The chat answer in Responses terms: its status, headers and token counts stay."""
    if answer.stream is not None:
        return PoolAnswer(answer.status, EVENT_STREAM, stream=_events(request, answer.stream, response_id))
    if answer.status != 200:
        return PoolAnswer(answer.status, answer.content_type, protocol.refusal_body(answer.body), headers=answer.headers)
    try:
        completion = json.loads(answer.body)
    except ValueError:
        raise api_errors.replica_failed("the backend's chat completion was not JSON") from None
    response = protocol.response_object(request, completion, response_id, int(time.time()))
    return PoolAnswer(200, JSON, json.dumps(response).encode(), headers=answer.headers, tokens=answer.tokens)


async def _events(request: protocol.ResponsesRequest, chunks: AsyncIterator[bytes], response_id: str) -> AsyncIterator[bytes]:
    stream = protocol.ResponseStream(request, response_id, int(time.time()), clock=lambda: int(time.time()))
    try:
        async for chunk in chunks:
            if events := stream.feed(chunk):
                yield events
        yield stream.end()
    finally:
        # Also when the client goes away: the relay closes its connection to the pool (which stops the
        # generation) and counts what was sent.
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()


async def lookup_refusal(authorization: str | None, response_id: str) -> api_errors.ApiError:
    """GET or DELETE /v1/responses/{id}: a caller with a valid key learns that nothing is stored."""
    await authorize(bearer_key(authorization), None)
    return protocol.response_not_stored(response_id)
