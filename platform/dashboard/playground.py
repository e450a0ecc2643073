"""What the playground page may send: a chat, checked here, then streamed through the gateway.

The browser never sees an API key; the signed-in session's organization stands in for one. The
body the pool receives is built here from checked fields only (the API passes bodies through to
vLLM, but a page has no reason to set anything beyond these).
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core import api_errors, strict_json

MAX_MESSAGES = 100
MAX_MESSAGE_CHARS = 20_000


class PlaygroundMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant"]
    content: str = Field(min_length=1, max_length=MAX_MESSAGE_CHARS)


class PlaygroundChat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1)
    messages: list[PlaygroundMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int = Field(256, ge=1, le=4096)
    temperature: float = Field(0.7, ge=0, le=2)


def completion_body(raw: bytes) -> bytes:
    """The streamed chat-completions request for a playground message; a 400 ``ApiError`` naming
    the field to fix when the page sent something else."""
    data = strict_json.body(raw)  # plain JSON, as the API's bodies
    try:
        chat = PlaygroundChat.model_validate(data)
    except ValidationError as exc:
        raise api_errors.invalid_fields(exc) from None
    body = chat.model_dump() | {"stream": True, "stream_options": {"include_usage": True}}
    return json.dumps(body).encode()
