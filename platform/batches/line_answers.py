"""A batch's lines, from their bodies to their result rows, through the path every completion takes:
the gateway's checks of the request's fields and caps (``core.request_limits``), the caller's
access to the model it names, its mix included (``answering.access``: checked once per target, as
its lines run together), the answer from the model's backend through ``answering.batch`` (counted in
the organization's usage as batch usage), and the output-file or error-file line it makes.

Each line is answered at its own ``url``: chat completions and completions as they are; a Responses
line (``/v1/responses``) as the chat completion it means (``core.responses_protocol``, as the gateway
translates it), whose answer its output line holds as a Response.

A line refused or failed becomes an error-file line with its custom_id and never stops the batch.
Lines are answered grouped by the model (and mix) they name, each group in line order, so the
requests for one adapter run together: the replica loads it once and batches its lines, instead of
swapping adapters from line to line (``benchmarks/batch_bench.py`` measures both orders).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass

from django.conf import settings

from accounts.models import Organization
from answering.access import usable_target
from answering.batch import Answerer, Reply, Target
from base.records import new_id
from batches.models import BatchResult
from core import api_errors
from core import responses_protocol
from core.batch_input import BatchRequest
from core.openai_protocol import parse_request
from core.request_limits import check_request
from core.responses_protocol import ResponsesRequest
from usage.answers import Tokens

CHAT = "chat/completions"
# A backend that is busy or restarting (429 adapter slots busy, 503 no replica yet) is asked again,
# a few times and more slowly each time, before the line goes to the error file.
TRANSIENT = (429, 503)
RETRIES = 3
RETRY_WAIT_S = 5.0


@dataclass(frozen=True)
class Checked:
    """A line that passed the gateway's checks: the body to send, where, and what answers it."""

    request: BatchRequest
    body: bytes
    target: Target
    endpoint: str = CHAT  # where the body goes: chat/completions or completions
    responses: ResponsesRequest | None = None  # a Responses line, answered as the chat completion ``body`` is


def group_key(request: BatchRequest) -> str:
    """Lines that name the same model and mix share a key (their adapter set on the replica)."""
    return json.dumps([request.body.get("model"), request.body.get("adapters")], sort_keys=True, default=str)


def in_groups(requests: Iterable[BatchRequest]) -> list[list[BatchRequest]]:
    """The lines grouped by ``group_key``, groups in the order their first line comes, each in line order."""
    groups: dict[str, list[BatchRequest]] = {}
    for request in requests:
        groups.setdefault(group_key(request), []).append(request)
    return list(groups.values())


def checked(request: BatchRequest) -> Checked | api_errors.ApiError:
    """The line's body as the gateway would take it, or its refusal (its fields, caps and types)."""
    endpoint, data, responses = request.url.removeprefix("/v1/"), request.body, None
    try:
        if endpoint == responses_protocol.ENDPOINT:
            responses = responses_protocol.request_from(request.body)
            endpoint, data = CHAT, responses_protocol.chat_body(responses)
        body = json.dumps(data).encode()
        parsed = parse_request(body)
        check_request(parsed.data, endpoint, settings.CONFIG.request_limits)
    except api_errors.ApiError as exc:
        return responses_protocol.in_responses_terms(exc) if responses is not None else exc
    adapters = tuple((share.model, share.scale) for share in parsed.routed.adapters or ())
    return Checked(request, body, Target(parsed.routed.model, adapters), endpoint, responses)


class Access:
    """Whether the organization may use each target, asked once per target for the batch's run."""

    def __init__(self, organization: Organization):
        self.organization = organization
        self._known: dict[Target, api_errors.ApiError | None] = {}

    def refusal(self, target: Target) -> api_errors.ApiError | None:
        if target not in self._known:
            try:
                usable_target(self.organization, target)
                self._known[target] = None
            except api_errors.ApiError as exc:
                self._known[target] = exc
        return self._known[target]


def answered(answerer: Answerer, access: Access, requests: list[BatchRequest], batch_id: str) -> list[BatchResult]:
    """Each line's result row (not saved), in order: the allowed lines are sent at once."""
    outcomes: list[Checked | api_errors.ApiError] = []
    for request in requests:
        line = checked(request)
        if isinstance(line, Checked):
            line = access.refusal(line.target) or line
        outcomes.append(line)
    sendable = [line for line in outcomes if isinstance(line, Checked)]
    replies = iter(_sent(answerer, [(line.endpoint, line.body) for line in sendable]))
    return [
        _replied(batch_id, outcome, next(replies))
        if isinstance(outcome, Checked)
        else _refused(batch_id, request, outcome)
        for request, outcome in zip(requests, outcomes)
    ]


def _sent(answerer: Answerer, bodies: list[tuple[str, bytes]]) -> list[Reply]:
    replies = answerer.send(bodies, batch=True) if bodies else []
    for attempt in range(RETRIES):
        again = [index for index, reply in enumerate(replies) if reply.status in TRANSIENT]
        if not again:
            break
        time.sleep(RETRY_WAIT_S * (attempt + 1))
        for index, reply in zip(again, answerer.send([bodies[index] for index in again], batch=True)):
            replies[index] = reply
    return replies


def _row(batch_id: str, request: BatchRequest, ok: bool, record: dict, tokens: Tokens = Tokens()) -> BatchResult:
    return BatchResult(
        id=record["id"], batch_id=batch_id, line=request.line, custom_id=request.custom_id, ok=ok,
        record=json.dumps(record), input_tokens=tokens.prompt, output_tokens=tokens.completion,
        cached_tokens=tokens.cached,
    )


def _refused(batch_id: str, request: BatchRequest, error: api_errors.ApiError) -> BatchResult:
    """OpenAI's error-file line for a request that was never sent: no response, the reason."""
    record = {
        "id": new_id("batch_req", "_"), "custom_id": request.custom_id, "response": None,
        "error": {"code": error.code or error.type, "message": error.message},
    }
    return _row(batch_id, request, False, record)


def _replied(batch_id: str, line: Checked, reply: Reply) -> BatchResult:
    """The output-file line of a 200; the error-file line, with the response, of any other status."""
    request, result_id = line.request, new_id("batch_req", "_")
    try:
        body = json.loads(reply.body if line.responses is None else responses_protocol.refusal_body(reply.body))
    except ValueError:
        body = None
    if line.responses is not None and reply.status == 200 and isinstance(body, dict):
        now = int(time.time())
        body = responses_protocol.response_object(line.responses, body, responses_protocol.new_response_id(), now)
    request_id = body.get("id") if isinstance(body, dict) and isinstance(body.get("id"), str) else result_id
    response = {"status_code": reply.status, "request_id": request_id, "body": body}
    if reply.status == 200 and isinstance(body, dict):
        record = {"id": result_id, "custom_id": request.custom_id, "response": response, "error": None}
        return _row(batch_id, request, True, record, reply.tokens)
    error: dict = body["error"] if isinstance(body, dict) and isinstance(body.get("error"), dict) else {}
    reason = {
        "code": str(error.get("code") or error.get("type") or reply.status),
        "message": api_errors.scrubbed(str(error.get("message") or f"the model's backend answered {reply.status}")),
    }
    record = {"id": result_id, "custom_id": request.custom_id, "response": response, "error": reason}
    return _row(batch_id, request, False, record, reply.tokens)
