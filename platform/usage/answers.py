"""What a completion cost, read from the pool's answer as it passes through the gateway.

A whole answer carries ``usage``. A stream carries it only in its last event, and only when the
request sets ``stream_options.include_usage``: the gateway sets it on every stream
(``answering.forwarded_body``), reads that event here, and takes it out again when the caller did
not ask for it, so the caller gets the stream it asked for.

A stream the caller leaves before its end has no usage event. It counts the chunks relayed as
its completion tokens (vLLM sends one token a chunk) and the gateway's estimate of its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import pydantic_core

_EVENT_END = b"\n\n"
_DATA = b"data: "


@dataclass(frozen=True)
class Tokens:
    prompt: int = 0
    completion: int = 0
    cached: int = 0  # of ``prompt``, read from the prefix cache


def _tokens(usage: object) -> Tokens | None:
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Tokens(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0), int(cached or 0))


def _json(raw: bytes) -> object:
    try:
        return pydantic_core.from_json(raw)
    except ValueError:
        return None


def whole_answer_tokens(body: bytes) -> Tokens | None:
    """The ``usage`` of an answer given in one piece; None if it has none."""
    answer = _json(body)
    return _tokens(answer.get("usage")) if isinstance(answer, dict) else None


class StreamTokens:
    """Reads a stream's usage event as the stream's bytes pass: ``feed`` each chunk and relay what
    it returns (whole events; a part of one waits for its end), then relay ``end()``."""

    def __init__(self, caller_asked_for_usage: bool, prompt_estimate: int):
        self._pass_usage_event = caller_asked_for_usage
        self._prompt_estimate = prompt_estimate
        self._pending = b""
        self._chunks = 0
        self.usage: Tokens | None = None

    def feed(self, data: bytes) -> bytes:
        *events, self._pending = (self._pending + data).split(_EVENT_END)
        return b"".join(event + _EVENT_END for event in events if self._relayed(event))

    def end(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest

    @property
    def tokens(self) -> Tokens:
        """The usage event's counts, or the estimate of a stream left before its end."""
        return self.usage or Tokens(self._prompt_estimate, self._chunks)

    def _relayed(self, event: bytes) -> bool:
        if b'"usage"' in event and event.startswith(_DATA):
            chunk = _json(event[len(_DATA) :])
            if isinstance(chunk, dict) and not chunk.get("choices") and chunk.get("usage"):
                self.usage = _tokens(chunk["usage"])
                return self._pass_usage_event
        if event.startswith(_DATA) and event != b"data: [DONE]":
            self._chunks += 1
        return True
