"""Send a checked completion request to its model's backend and count what it cost.

``forward`` takes a body the caller's side has already checked (fields, caps, the models it names:
``check_mix`` for a mix) and gives back the backend's answer as it came: a stream stays a stream.
Whoever asked, the organization's own prefix cache (``answering.cache_salt``), its share of the
adapter slots (``ORGANIZATION_HEADER``) and its usage (``usage.meter``) are the same.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from answering.cache_salt import cache_salt
from answering.forwarded_body import asks_for_usage, forwarded_body
from answering.tool_call_pieces import with_openai_tool_call_pieces
from base.serving_client import pool_http, serving_url
from core import api_errors
from core.http_client import UpstreamError, UpstreamResponse, UpstreamTimeout
from core.openai_protocol import BACKGROUND_HEADER, ORGANIZATION_HEADER, ParsedRequest, RoutedFields
from finetuning.registry import UsableModel
from usage.answers import StreamTokens, Tokens, whole_answer_tokens
from usage.meter import METER, Caller

JSON = "application/json"


@dataclass
class PoolAnswer:
    status: int
    content_type: str
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None  # set for a streamed answer, instead of body
    headers: dict[str, str] = field(default_factory=dict)  # the pool's Retry-After on a refusal
    tokens: Tokens | None = None  # what a whole answer cost, as counted


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


async def forward(
    body: bytes, request: ParsedRequest, endpoint: str, caller: Caller, prompt_estimate: int = 0,
    background: bool = False,
) -> PoolAnswer:
    """The backend's answer to ``body`` (``request`` is its parsed form), counted for ``caller``.
    ``prompt_estimate``: the prompt tokens a stream left before its end counts (the gateway's estimate);
    ``background``: work nobody waits on token by token, which yields to live requests on its replica."""
    stream = request.routed.stream
    body = forwarded_body(body, request.data, cache_salt(caller.organization_id), stream)
    headers = {ORGANIZATION_HEADER: str(caller.organization_id)}  # for fair use of a replica's adapter slots
    if background:
        headers[BACKGROUND_HEADER] = "1"
    try:
        upstream = await pool_http().post(serving_url(request.routed.model, f"/v1/{endpoint}"), body, headers=headers)
    except UpstreamError as exc:
        raise _unreachable(exc) from None
    content_type = upstream.headers.get("content-type", JSON)
    if stream and upstream.status == 200:
        tokens = StreamTokens(asks_for_usage(request.data), prompt_estimate)
        return PoolAnswer(upstream.status, content_type, stream=_relay(upstream, tokens, caller))
    try:
        raw = await upstream.read()
    except UpstreamError as exc:
        raise _unreachable(exc) from None
    counted = None
    if upstream.status == 200:
        counted = whole_answer_tokens(raw) or Tokens()
        METER.record(caller, counted)
    retry_after = upstream.headers.get("retry-after")
    headers = {"Retry-After": retry_after} if retry_after else {}
    return PoolAnswer(upstream.status, content_type, body=raw, headers=headers, tokens=counted)


def _unreachable(exc: UpstreamError) -> api_errors.ApiError:
    if isinstance(exc, UpstreamTimeout):
        return api_errors.pool_timeout(str(exc))
    return api_errors.pool_unreachable(str(exc))


async def _relay(upstream: UpstreamResponse, tokens: StreamTokens, caller: Caller) -> AsyncIterator[bytes]:
    try:
        async for chunk in upstream.iter_body():
            if relayed := tokens.feed(chunk):
                yield with_openai_tool_call_pieces(relayed)
        if rest := tokens.end():
            yield with_openai_tool_call_pieces(rest)
    finally:
        upstream.close()  # also when the client goes away: the pool then stops the generation
        METER.record(caller, tokens.tokens)
