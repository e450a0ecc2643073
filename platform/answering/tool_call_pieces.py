"""OpenAI's shape for a streamed tool call's first piece, where vLLM's differs.

vLLM opens a streamed call with ``{"name": ...}`` and no ``arguments``; OpenAI's first piece carries
``"arguments": ""``, and the function calling guide's accumulation loop relies on it
(``final_tool_calls[index].function.arguments += tool_call.function.arguments`` fails on ``None``).
The events of a stream that hold tool calls get the empty string; every other event passes as it
came, unparsed.
"""

from __future__ import annotations

import json

import pydantic_core

_EVENT_END = b"\n\n"
_DATA = b"data: "
_TOOL_CALLS = b'"tool_calls"'


def with_openai_tool_call_pieces(events: bytes) -> bytes:
    """``events``: whole server-sent events, as the gateway relays them."""
    if _TOOL_CALLS not in events:
        return events
    return _EVENT_END.join(_shaped(event) for event in events.split(_EVENT_END))


def _shaped(event: bytes) -> bytes:
    if not event.startswith(_DATA) or _TOOL_CALLS not in event:
        return event
    try:
        chunk = pydantic_core.from_json(event[len(_DATA) :])
    except ValueError:
        return event
    if not isinstance(chunk, dict) or not _fill_arguments(chunk):
        return event
    return _DATA + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode()


def _fill_arguments(chunk: dict) -> bool:
    """Give each call piece without arguments an empty string of them; whether any lacked them."""
    filled = False
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        for call in (delta.get("tool_calls") or []) if isinstance(delta, dict) else []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and function.get("arguments") is None:
                function["arguments"] = ""
                filled = True
    return filled
