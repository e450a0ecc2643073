"""What the playground page may send: a chat, checked here, then streamed through the gateway.

The browser never sees an API key; the signed-in session's organization stands in for one. The
body the pool receives is built here from checked fields only (the API passes bodies through to
vLLM, but a page has no reason to set anything beyond these).
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from core import api_errors, strict_json

MAX_MESSAGES = 100
MAX_MESSAGE_CHARS = 20_000
MAX_TOOLS = 32


class PlaygroundCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(max_length=MAX_MESSAGE_CHARS)


class PlaygroundCall(BaseModel):
    """A call the model made, sent back with the conversation (OpenAI's shape)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: PlaygroundCallFunction


class PlaygroundMessage(BaseModel):
    """A turn: an assistant's may hold the calls it made (its content then empty), and a ``tool`` turn
    is a call's result, which the person at the page types in."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(max_length=MAX_MESSAGE_CHARS)
    tool_calls: list[PlaygroundCall] | None = Field(None, min_length=1, max_length=16)
    tool_call_id: str | None = Field(None, min_length=1, max_length=128)

    @model_validator(mode="after")
    def _says_something(self) -> PlaygroundMessage:
        if not self.content and not self.tool_calls:
            raise ValueError("a message needs content (or, from the assistant, tool_calls)")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message, and only it, answers a call: it needs tool_call_id")
        return self


class PlaygroundChat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1)
    messages: list[PlaygroundMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int = Field(256, ge=1, le=4096)
    temperature: float = Field(0.7, ge=0, le=2)
    # As the API takes them; the gateway checks their shape (``core.tool_calls``) as it does the API's.
    tools: list[dict] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none", "required"] | None = None


def completion_body(raw: bytes) -> bytes:
    """The streamed chat-completions request for a playground message; a 400 ``ApiError`` naming
    the field to fix when the page sent something else."""
    data = strict_json.body(raw)  # plain JSON, as the API's bodies
    try:
        chat = PlaygroundChat.model_validate(data)
    except ValidationError as exc:
        raise api_errors.invalid_fields(exc) from None
    body = chat.model_dump(exclude_none=True) | {"stream": True, "stream_options": {"include_usage": True}}
    return json.dumps(body).encode()
