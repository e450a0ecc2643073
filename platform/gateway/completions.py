"""The completions handler, shared by the Django views, the ASGI fast path (``gateway.asgi``) and
the dashboard's playground.

Find out who is calling (an API key here, a signed-in session in the playground), hold them to
their completions and tokens per minute (``gateway.limits``), check the request's fields and caps
(``gateway.request_limits``) and that they may use the model (``finetuning.registry``, through
``gateway.access``), then hand the body to the inference pool with the fields the gateway sets
(``gateway.forwarded_body``), otherwise as it came, and give back its answer the same way (a stream
stays a stream). Each answer's tokens are counted on the way (``usage.meter``). The body is parsed
once, here.

A mix (``adapters``) is checked here as ``model`` is: each model it names must be one the caller
may use, and a fine-tune of the base model ``model`` names. The pool builds and serves it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from django.conf import settings
from django.http import HttpResponse, StreamingHttpResponse

from accounts.models import Organization
from base.serving_client import pool_http, serving_url
from core import api_errors
from core.http_client import UpstreamError, UpstreamResponse, UpstreamTimeout
from core.openai_protocol import ORGANIZATION_HEADER, ParsedRequest, RoutedFields, parse_request
from gateway.access import authorize, organization_model
from gateway.cache_salt import cache_salt
from gateway.forwarded_body import asks_for_usage, forwarded_body
from gateway.limits import check_completion_rate, estimated_prompt_tokens, estimated_tokens
from gateway.request_limits import check_request
from finetuning.registry import UsableModel
from usage.answers import StreamTokens, Tokens, whole_answer_tokens
from usage.meter import METER, Caller

JSON = "application/json"
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class PoolAnswer:
    status: int
    content_type: str
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None  # set for a streamed answer, instead of body
    headers: dict[str, str] = field(default_factory=dict)  # the pool's Retry-After on a refusal


def bearer_key(authorization: str | None) -> str:
    scheme, _, raw_key = (authorization or "").partition(" ")
    if scheme != "Bearer" or not raw_key.strip():
        raise api_errors.missing_api_key()
    return raw_key.strip()


def checked_request(body: bytes, endpoint: str) -> ParsedRequest:
    request = parse_request(body)
    check_request(request.data, endpoint, settings.CONFIG.request_limits)
    return request


async def complete(authorization: str | None, body: bytes, endpoint: str) -> PoolAnswer:
    raw_key = bearer_key(authorization)
    try:
        request = checked_request(body, endpoint)
    except api_errors.ApiError:
        await authorize(raw_key, None)  # a bad key is a 401 even when the body is also wrong
        raise
    access = await authorize(raw_key, request.routed.model)
    tokens = estimated_tokens(request.data, endpoint, access.model)
    await check_completion_rate(access.api_key.organization_id, access.api_key.pk, tokens)
    if access.model is None:
        raise api_errors.model_not_found(request.routed.model)

    async def usable(name: str) -> UsableModel | None:
        return (await authorize(raw_key, name)).model

    await check_mix(access.model, request.routed, usable)
    caller = Caller(access.api_key.organization_id, access.api_key.pk, request.routed.model)
    return await _forward(body, request, endpoint, caller)


async def complete_for_organization(organization: Organization, body: bytes, endpoint: str) -> PoolAnswer:
    """For a caller the dashboard has already signed in: the organization stands in for a key."""
    request = checked_request(body, endpoint)
    model = await organization_model(organization, request.routed.model)
    await check_completion_rate(organization.pk, tokens=estimated_tokens(request.data, endpoint, model))
    if model is None:
        raise api_errors.model_not_found(request.routed.model)

    async def usable(name: str) -> UsableModel | None:
        return await organization_model(organization, name)

    await check_mix(model, request.routed, usable)
    return await _forward(body, request, endpoint, Caller(organization.pk, None, request.routed.model))


async def check_mix(
    model: UsableModel, routed: RoutedFields, usable: Callable[[str], Awaitable[UsableModel | None]]
) -> None:
    """``model`` is a base model, and each model ``adapters`` names is one of its fine-tunes that the
    caller may use (an unknown one, or another organization's, is the same 404 as for ``model``).
    Every listed model is checked, those at scale 0 too: the caller named them."""
    if routed.adapters is None:
        return
    if model.suffix is not None:
        raise api_errors.mix_needs_base_model(model.name)
    for name in dict.fromkeys(share.model for share in routed.adapters):
        part = await usable(name)
        if part is None:
            raise api_errors.model_not_found(name, param="adapters")
        if part.suffix is None or part.base_model_id != model.name:
            raise api_errors.not_a_fine_tune_of(name, model.name)


async def _forward(body: bytes, request: ParsedRequest, endpoint: str, caller: Caller) -> PoolAnswer:
    stream = request.routed.stream
    body = forwarded_body(body, request.data, cache_salt(caller.organization_id), stream)
    try:
        upstream = await pool_http().post(
            serving_url(request.routed.model, f"/v1/{endpoint}"), body,
            headers={ORGANIZATION_HEADER: str(caller.organization_id)},  # for fair use of the pool's adapter slots
        )  # fmt: skip
    except UpstreamError as exc:
        raise _unreachable(exc) from None
    content_type = upstream.headers.get("content-type", JSON)
    if stream and upstream.status == 200:
        tokens = StreamTokens(asks_for_usage(request.data), estimated_prompt_tokens(request.data, endpoint))
        return PoolAnswer(upstream.status, content_type, stream=_relay(upstream, tokens, caller))
    try:
        raw = await upstream.read()
    except UpstreamError as exc:
        raise _unreachable(exc) from None
    if upstream.status == 200:
        METER.record(caller, whole_answer_tokens(raw) or Tokens())
    retry_after = upstream.headers.get("retry-after")
    return PoolAnswer(upstream.status, content_type, body=raw, headers={"Retry-After": retry_after} if retry_after else {})


def _unreachable(exc: UpstreamError) -> api_errors.ApiError:
    if isinstance(exc, UpstreamTimeout):
        return api_errors.pool_timeout(str(exc))
    return api_errors.pool_unreachable(str(exc))


async def _relay(upstream: UpstreamResponse, tokens: StreamTokens, caller: Caller) -> AsyncIterator[bytes]:
    try:
        async for chunk in upstream.iter_body():
            if relayed := tokens.feed(chunk):
                yield relayed
        if rest := tokens.end():
            yield rest
    finally:
        upstream.close()  # also when the client goes away: the pool then stops the generation
        METER.record(caller, tokens.tokens)


def pool_response(answer: PoolAnswer) -> HttpResponse | StreamingHttpResponse:
    """The pool's answer as it came: a stream stays a stream."""
    if answer.stream is not None:
        return StreamingHttpResponse(
            answer.stream, status=answer.status, content_type=answer.content_type, headers=STREAM_HEADERS
        )
    return HttpResponse(answer.body, status=answer.status, content_type=answer.content_type, headers=answer.headers)
