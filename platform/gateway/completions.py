"""The completions handler, shared by the Django views, the ASGI fast path (``gateway.asgi``) and
the dashboard's playground.

Find out who is calling (an API key here, a signed-in session in the playground), hold them to
their completions and tokens per minute (``gateway.limits``), check the request's fields and caps
(``core.request_limits``) and that they may use the model (``finetuning.registry``, through
``gateway.access``), then hand the body to the inference pool with the fields the gateway sets
(``answering.forwarded_body``), otherwise as it came, and give back its answer the same way (a stream
stays a stream). Each answer's tokens are counted on the way (``usage.meter``). The body is parsed
once, here.

A mix (``adapters``) is checked here as ``model`` is: each model it names must be one the caller
may use, and a fine-tune of the base model ``model`` names (``answering.forward.check_mix``). The
pool builds and serves it. Sending, routing and counting are ``answering.forward``'s, the path the
workers' answers (evaluation runs, the publish gate) take too.
"""

from __future__ import annotations

from django.conf import settings
from django.http import HttpResponse, StreamingHttpResponse

from accounts.models import Organization
from answering.forward import PoolAnswer, check_mix, forward
from core import api_errors
from core.openai_protocol import ParsedRequest, parse_request
from core.request_limits import check_request, estimated_prompt_tokens
from gateway.access import authorize, organization_model
from gateway.limits import check_completion_rate, estimated_tokens
from finetuning.registry import UsableModel
from usage.meter import Caller

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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
    check_tools(access.model, request)
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
    check_tools(model, request)
    return await _forward(body, request, endpoint, Caller(organization.pk, None, request.routed.model))


def check_tools(model: UsableModel, request: ParsedRequest) -> None:
    """Tools only for a model whose chat template renders them (its replicas run the matching parser)."""
    if request.data.get("tools") and settings.MODEL_CATALOG.require(model.base_model_id).tools is None:
        raise api_errors.tools_not_rendered(model.base_model_id)


async def _forward(body: bytes, request: ParsedRequest, endpoint: str, caller: Caller) -> PoolAnswer:
    return await forward(body, request, endpoint, caller, estimated_prompt_tokens(request.data, endpoint))


def pool_response(answer: PoolAnswer) -> HttpResponse | StreamingHttpResponse:
    """The pool's answer as it came: a stream stays a stream."""
    if answer.stream is not None:
        return StreamingHttpResponse(
            answer.stream, status=answer.status, content_type=answer.content_type, headers=STREAM_HEADERS
        )
    return HttpResponse(answer.body, status=answer.status, content_type=answer.content_type, headers=answer.headers)
