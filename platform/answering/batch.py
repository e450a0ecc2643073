"""Answers a worker asks for (an evaluation run, the publish gate, a Batch API line): chat completions
sent through ``answering.forward``, so they reach the model's own backend and count in the
organization's usage as any completion does. They are background work: in the pool they yield to
live requests (``inference.replica.BACKGROUND_BESIDE_LIVE``), since nobody waits on them token by token.

An ``Answerer`` holds an event loop for its lifetime, so the backends' connections are kept from one
batch to the next; a batch's answers run at once (the engine batches them), and each comes back
as text or as the reason there is none. The worker's usage counts are written after each batch
(nobody else writes them in a worker process).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Self

from answering.forward import forward
from base.serving_client import pool_http
from core import api_errors
from core.openai_protocol import parse_request
from usage.answers import Tokens
from usage.meter import METER, Caller

CHAT = "chat/completions"


@dataclass(frozen=True)
class Target:
    """What answers: a model by any name that serves here, maybe with a mix of its fine-tunes."""

    model: str
    adapters: tuple[tuple[str, float], ...] = ()  # (fine-tuned model, scale); empty: no mix

    def fields(self) -> dict:
        mix = {"adapters": [{"model": name, "scale": scale} for name, scale in self.adapters]} if self.adapters else {}
        return {"model": self.model, **mix}


@dataclass(frozen=True)
class Sampling:
    max_completion_tokens: int = 64
    temperature: float = 0.0  # greedy: a score that can be compared from run to run
    top_p: float = 1.0
    seed: int | None = None
    response_format: dict | None = None  # as chat takes it (an eval run's sampling_params, a model grader's verdict)
    tools: list[dict] | None = None

    def fields(self) -> dict:
        return {key: value for key, value in asdict(self).items() if value is not None}


@dataclass(frozen=True)
class Answer:
    text: str | None  # None: no answer, and ``error_code``/``error_message`` say why
    answered_by: str = ""  # the answer's "model" (a fine-tune's pinned revision, a mix's name)
    finish_reason: str = ""
    tokens: Tokens = Tokens()
    error_code: str = ""
    error_message: str = ""
    tool_calls: list[dict] | None = None  # the message's, as OpenAI shapes them


@dataclass(frozen=True)
class Reply:
    """A whole request's answer as its backend gave it (``Answerer.send``): its status and body, which
    is OpenAI-shaped JSON either way; a refusal before it reached the backend (the pool unreachable,
    say) in the same shape."""

    status: int
    body: bytes
    tokens: Tokens = Tokens()


class Answerer:
    """Chat answers for one organization, a batch at a time (use it in a ``with`` block)."""

    def __init__(self, organization_id: int):
        self.organization_id = organization_id
        self._runner = asyncio.Runner()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        async def close_connections() -> None:
            await pool_http().aclose()  # this loop's: the backends' connections it kept

        try:
            self._runner.run(close_connections())
        finally:
            self._runner.close()
            METER.flush()

    def answer(self, target: Target, prompts: list[list[dict]], sampling: Sampling) -> list[Answer]:
        """Each prompt's answer, in order; the batch's usage is written before it returns."""

        async def batch() -> list[Answer]:
            return list(await asyncio.gather(*(self._one(target, prompt, sampling) for prompt in prompts)))

        try:
            return self._runner.run(batch())
        finally:
            METER.flush()

    def send(self, requests: list[tuple[str, bytes]], batch: bool = False) -> list[Reply]:
        """Each request's answer, in order, sent at once (the engine batches them): (endpoint, body)
        pairs, ``chat/completions`` or ``completions``, whose bodies have passed the gateway's checks.
        ``batch``: counted as Batch API usage."""

        async def sent() -> list[Reply]:
            return list(await asyncio.gather(*(self._reply(endpoint, body, batch) for endpoint, body in requests)))

        try:
            return self._runner.run(sent())
        finally:
            METER.flush()

    async def _reply(self, endpoint: str, body: bytes, batch: bool) -> Reply:
        try:
            request = parse_request(body)
            caller = Caller(self.organization_id, None, request.routed.model, batch)
            answered = await forward(body, request, endpoint, caller, background=True)
        except api_errors.ApiError as exc:
            return Reply(exc.status, exc.json_bytes())
        return Reply(answered.status, answered.body, answered.tokens or Tokens())

    async def _one(self, target: Target, prompt: list[dict], sampling: Sampling) -> Answer:
        body = json.dumps({**target.fields(), "messages": prompt, **sampling.fields()}).encode()
        try:
            request = parse_request(body)
            caller = Caller(self.organization_id, None, target.model)
            answered = await forward(body, request, CHAT, caller, background=True)
        except api_errors.ApiError as exc:
            return Answer(None, error_code=exc.code or exc.type, error_message=exc.message)
        if answered.status != 200:
            return _refusal(answered.status, answered.body)
        return _answer(answered.body, answered.tokens or Tokens())


def refusal_words(status: int, raw: bytes) -> tuple[str, str]:
    """The backend's own code and words for a refusal (its errors are OpenAI-shaped; addresses taken out)."""
    try:
        error = json.loads(raw)["error"]
        code, message = str(error.get("code") or error.get("type") or status), str(error["message"])
    except (ValueError, KeyError, TypeError):
        code, message = str(status), f"the serving backend answered {status}"
    return code, api_errors.scrubbed(message)


def _refusal(status: int, raw: bytes) -> Answer:
    code, message = refusal_words(status, raw)
    return Answer(None, error_code=code, error_message=message)


def _answer(raw: bytes, tokens: Tokens) -> Answer:
    try:
        answer = json.loads(raw)
        choice = answer["choices"][0]
        text = choice["message"]["content"] or ""
        tool_calls = choice["message"].get("tool_calls") or None
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return Answer(None, error_code="invalid_answer", error_message="the serving backend's answer had no message")
    return Answer(
        text, str(answer.get("model") or ""), str(choice.get("finish_reason") or ""), tokens, tool_calls=tool_calls
    )
