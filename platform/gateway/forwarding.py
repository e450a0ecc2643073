"""The gateway's completions handler: authenticate, authorize the model, hand the body to the pool.

The body goes to the pool byte for byte, and its answer comes back the same way (a stream stays a
stream): the gateway adds one key lookup and one registry read, nothing else.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse

from gateway.access import authorize, bearer_key
from gateway.pool_client import pool_client, pool_url
from inference import errors
from inference.protocol import routed_fields

JSON = "application/json"


async def forward_completion(request: HttpRequest, endpoint: str) -> HttpResponse:
    raw_key = bearer_key(request)
    body = request.body
    try:
        fields = routed_fields(body)
    except errors.ApiError:
        await authorize(raw_key, None)  # a bad key is a 401 even when the body is also wrong
        raise
    access = await authorize(raw_key, fields.model)
    if access.model is None:
        raise errors.model_not_found(fields.model)
    client = pool_client()
    try:
        upstream = await client.send(
            client.build_request("POST", pool_url(f"/v1/{endpoint}"), content=body, headers={"content-type": JSON}),
            stream=True,
        )
    except httpx.TransportError as exc:
        raise errors.pool_unreachable(repr(exc)) from None
    if fields.stream and upstream.status_code == 200:
        return StreamingHttpResponse(
            _relay(upstream), content_type=upstream.headers.get("content-type", "text/event-stream"),
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )  # fmt: skip
    try:
        raw = await upstream.aread()
    except httpx.TransportError as exc:
        raise errors.pool_unreachable(repr(exc)) from None
    finally:
        await upstream.aclose()
    return HttpResponse(raw, status=upstream.status_code, content_type=JSON)


async def _relay(upstream: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    finally:
        await upstream.aclose()  # also when the client goes away: the pool then stops the generation
