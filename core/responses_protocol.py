"""OpenAI's Responses API (``POST /v1/responses``) as a translation of chat completions.

Every model here is served through chat completions (the gateway's checks, the pool, Ray Serve, the
usage meter), so a Responses request is turned into the chat completions body it means
(``chat_body``), sent down that one path, and the chat completion that comes back is turned into a
Response object (``response_object``), or its stream of chunks into the Responses stream of events
(``ResponseStream``). Pure functions and a parser: no I/O, no Django, so the batch worker and the
gateway translate the same way.

What is accepted is the subset the chat path can honour: text ``input`` (a string, or messages,
``function_call`` and ``function_call_output`` items), ``instructions``, function ``tools``,
``tool_choice``, ``parallel_tool_calls``, ``text.format``, ``max_output_tokens``, ``temperature``,
``top_p``, ``metadata``, ``user``, ``stream`` and the platform's ``adapters``. What OpenAI offers and
this platform does not (stored responses, built-in tools, images, reasoning, ...) is refused with a
400 naming the field (``NOT_OFFERED``), never silently ignored; an unknown field likewise.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    Tag,
    ValidationError,
    field_validator,
)

from core import api_errors, strict_json
from core.openai_protocol import AdapterShare, checked_metadata

ENDPOINT = "responses"

# OpenAI's fields this platform does not offer, each with why (the 400 says it). ``store`` and
# ``background`` are refused only when true: false asks for what happens here anyway.
_NOT_STORED = "responses are not stored here (every response is as if store=false)"
NOT_OFFERED: dict[str, str] = {
    "previous_response_id": f"{_NOT_STORED}: send the whole conversation in 'input' instead",
    "conversation": f"{_NOT_STORED}: send the whole conversation in 'input' instead",
    "store": f"{_NOT_STORED}; leave 'store' out or set it to false",
    "background": "responses are answered while the request waits; stream=true shows them as they come",
    "include": "no extra output data (reasoning, logprobs, search results) is produced here",
    "prompt": "stored prompt templates are not offered; send the text in 'instructions' and 'input'",
    "reasoning": "the models served here have no reasoning settings",
    "max_tool_calls": "tools run on the caller's side; limit the calls there",
    "top_logprobs": "log probabilities are offered by /v1/chat/completions (logprobs, top_logprobs)",
    "truncation": "a conversation longer than the model's context is refused, never truncated",
    "service_tier": "there is one service tier here",
    "prompt_cache_key": "each organization's prompt cache is its own already",
    "prompt_cache_retention": "each organization's prompt cache is its own already",
    "prompt_cache_options": "each organization's prompt cache is its own already",
    "safety_identifier": "send 'user' instead",
    "stream_options": "the stream's events are OpenAI's, without options",
    "context_management": "a conversation longer than the model's context is refused, never compacted",
    "moderation": "no moderation runs here",
    "image": "the models served here read and write text only",
    "access_programs": "not offered here",
    "background_options": "responses are answered while the request waits",
}
_OFF_VALUES: dict[str, tuple[object, ...]] = {"store": (None, False), "background": (None, False), "truncation": (None, "disabled")}
# Built-in tools OpenAI runs on its side; here only the caller's own function tools exist.
_BUILT_IN_TOOLS = "the caller's own function tools ({\"type\": \"function\", \"name\", \"parameters\"}) are offered, no built-in tools"
_TEXT_ONLY = "the models served here read text only: send 'input_text' parts"


def _problem(message: str, param: str, code: str = "invalid_value") -> api_errors.ApiError:
    return api_errors.ApiError(message, param=param, code=code)


def not_offered(name: str, why: str) -> api_errors.ApiError:
    return _problem(f"'{name}' is not offered by /v1/responses here: {why}.", name, "unsupported_parameter")


def unknown_field(name: str) -> api_errors.ApiError:
    return _problem(
        f"Unrecognized request argument supplied: '{api_errors.shown(name)}'. /v1/responses takes OpenAI's Responses "
        "fields that docs/api.md lists (and 'adapters'); vLLM's sampling extensions are offered by /v1/chat/completions.",
        name, "unknown_parameter",
    )


def response_not_stored(response_id: str) -> api_errors.ApiError:
    """GET or DELETE /v1/responses/{id}: nothing is kept to read or delete."""
    return api_errors.ApiError(
        f"No response '{api_errors.shown(response_id)}': {_NOT_STORED}, so none can be read back or deleted.",
        status=404, param="response_id", code="response_not_found",
    )


# --- the request -----------------------------------------------------------------------------------


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Closed):
    """``input_text`` (a user's, system's or developer's words) or ``output_text`` (an earlier answer's)."""

    type: Literal["input_text", "output_text"]
    text: StrictStr
    annotations: list[Any] | None = None  # an earlier answer's, as the client echoes it back: no meaning here
    logprobs: list[Any] | None = None


def _text_parts(value: object) -> object:
    """A message's content: a string is one text part; image, file and audio parts are refused."""
    if isinstance(value, str):
        return [{"type": "input_text", "text": value}]
    if isinstance(value, list):
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind.startswith("input_") and kind != "input_text":
                raise ValueError(f"'{kind}' content is not offered: {_TEXT_ONLY}")
            if kind == "refusal":
                raise ValueError("a 'refusal' part is not offered: send an earlier answer as 'output_text'")
        return value
    raise ValueError("must be a string or a list of {\"type\": \"input_text\", \"text\": ...} parts")


TextContent = Annotated[list[TextPart], BeforeValidator(_text_parts)]


class MessageItem(_Closed):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: TextContent
    id: StrictStr | None = None  # an earlier output item's, as the client echoes it back
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(_Closed):
    """An earlier answer's call of one of the caller's functions."""

    type: Literal["function_call"]
    call_id: StrictStr = Field(min_length=1)
    name: StrictStr = Field(min_length=1)
    arguments: StrictStr
    id: StrictStr | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Closed):
    """What the caller's function returned for ``call_id``."""

    type: Literal["function_call_output"]
    call_id: StrictStr = Field(min_length=1)
    output: Annotated[StrictStr | list[TextPart], BeforeValidator(lambda v: v if isinstance(v, str) else _text_parts(v))]
    id: StrictStr | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


_ITEM_TYPES = ("message", "function_call", "function_call_output")


def _item_kind(value: object) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message" if "role" in value else None)
        if kind is None:
            raise ValueError("an input item needs a 'type' (or a 'role', for a message)")
        if kind not in _ITEM_TYPES:
            raise ValueError(
                f"'{api_errors.shown(str(kind))}' items are not offered: input takes messages, 'function_call' and "
                "'function_call_output' items (responses are not stored, so an 'item_reference' points at nothing)"
            )
        return str(kind)
    return None


def _known_item(value: object) -> object:
    _item_kind(value)  # refuses unknown item types with a message that says what is taken
    return value


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind),
    BeforeValidator(_known_item),
]


def _input_items(value: object) -> object:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and not value:
        raise ValueError("must hold at least one item")
    return value


class FunctionTool(_Closed):
    type: Literal["function"]
    name: StrictStr = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


def _function_tool(value: object) -> object:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind is not None and kind != "function":
        raise ValueError(f"'{api_errors.shown(str(kind))}' tools are not offered: {_BUILT_IN_TOOLS}")
    return value


class NamedFunction(_Closed):
    type: Literal["function"]
    name: StrictStr = Field(min_length=1)


ToolChoiceMode = Literal["auto", "none", "required"]


def _tool_choice_kind(value: object) -> str:
    if isinstance(value, dict) and value.get("type") == "function":
        return "named"
    if isinstance(value, str):
        return "mode"
    raise ValueError("must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}")


ToolChoice = Annotated[
    Annotated[ToolChoiceMode, Tag("mode")] | Annotated[NamedFunction, Tag("named")],
    Discriminator(_tool_choice_kind),
    BeforeValidator(lambda value: (_tool_choice_kind(value), value)[1]),
]


class JsonSchemaFormat(_Closed):
    model_config = ConfigDict(populate_by_name=True)

    type: Literal["json_schema"]
    name: StrictStr = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    schema_: dict[str, Any] = Field(alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class PlainFormat(_Closed):
    type: Literal["text", "json_object"]


def _format_kind(value: object) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else None
    return "json_schema" if kind == "json_schema" else "plain" if isinstance(value, dict) else None


TextFormat = Annotated[
    Annotated[JsonSchemaFormat, Tag("json_schema")] | Annotated[PlainFormat, Tag("plain")], Discriminator(_format_kind)
]


class TextConfig(_Closed):
    format: TextFormat | None = None


class ResponsesRequest(_Closed):
    """The body of POST /v1/responses this platform serves (refused fields are checked before it)."""

    model: StrictStr = Field(min_length=1)
    input: Annotated[list[InputItem], BeforeValidator(_input_items)]
    instructions: StrictStr | None = None
    tools: list[Annotated[FunctionTool, BeforeValidator(_function_tool)]] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0, le=2)
    top_p: StrictFloat | None = Field(None, ge=0, le=1)
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    stream: StrictBool | None = None
    # What OpenAI's client may send with its default (false, or "disabled"), which is what happens here.
    store: StrictBool | None = None
    background: StrictBool | None = None
    truncation: Literal["disabled"] | None = None
    # ours: a mix of fine-tunes of the base model ``model`` names (docs/api.md: Mixing adapters)
    adapters: list[AdapterShare] | None = None

    _metadata = field_validator("metadata")(checked_metadata)

    @property
    def streamed(self) -> bool:
        return bool(self.stream)


# Tags a tagged union puts in an error's location: not fields, so a message leaves them out.
_TAGS = {"message", "function_call", "function_call_output", "json_schema", "plain", "mode", "named"}


def _field_path(location: tuple[int | str, ...]) -> str:
    parts = [str(part) for part in location if not (isinstance(part, str) and (part in _TAGS or "[" in part))]
    return ".".join(parts) or "body"


def _invalid(exc: ValidationError) -> api_errors.ApiError:
    problem = exc.errors()[0]
    where = _field_path(tuple(problem.get("loc", ())))
    message = str(problem["msg"]).removeprefix("Value error, ")
    error = api_errors.invalid_body(f"{where}: {message}")
    error.param = None if where == "body" else where
    return error


def parse_request(body: bytes) -> ResponsesRequest:
    """The body read as ``core.strict_json`` reads every body, then checked: a field OpenAI has and
    this platform does not offer, an unknown field, or a wrong value is a 400 naming it."""
    return request_from(api_errors.object_body(strict_json.body(body)))


def request_from(data: dict[str, Any]) -> ResponsesRequest:
    for name, why in NOT_OFFERED.items():
        if name in data and data[name] not in _OFF_VALUES.get(name, (None,)):
            raise not_offered(name, why)
    text = data.get("text")
    if isinstance(text, dict) and text.get("verbosity") is not None:
        raise not_offered("text.verbosity", "the models served here have no verbosity setting")
    if isinstance(text, dict) and "verbosity" in text:
        data = data | {"text": {key: value for key, value in text.items() if key != "verbosity"}}
    for name in data:
        if name not in ResponsesRequest.model_fields:
            raise unknown_field(name)
    try:
        return ResponsesRequest.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc) from None


# --- a Responses request as a chat completions request ---------------------------------------------


def _text(parts: list[TextPart]) -> str:
    return "\n".join(part.text for part in parts)  # as vLLM joins a chat message's text parts


def chat_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation in chat terms: instructions first (a system message), then each item; calls
    in a row (and the answer text just before them) are one assistant message, as chat has them."""
    messages: list[dict[str, Any]] = []
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
    for item in request.input:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role  # chat templates know no "developer"
            messages.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            output = item.output if isinstance(item.output, str) else _text(item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    return messages


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    function = tool.model_dump(exclude={"type"}, exclude_none=True)
    return {"type": "function", "function": function}


def _response_format(format: JsonSchemaFormat | PlainFormat) -> dict[str, Any]:
    if isinstance(format, PlainFormat):
        return {"type": format.type}
    return {"type": "json_schema", "json_schema": format.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)}


def chat_body(request: ResponsesRequest) -> dict[str, Any]:
    """The chat completions request that asks for what ``request`` does (a stream asks for its usage,
    which the Response reports)."""
    body: dict[str, Any] = {"model": request.model, "messages": chat_messages(request)}
    if request.adapters is not None:
        body["adapters"] = [share.model_dump() for share in request.adapters]
    if request.tools:
        body["tools"] = [_chat_tool(tool) for tool in request.tools]
    if isinstance(request.tool_choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": request.tool_choice.name}}
    elif request.tool_choice is not None:
        body["tool_choice"] = request.tool_choice
    if request.text is not None and request.text.format is not None:
        body["response_format"] = _response_format(request.text.format)
    fields = {
        "parallel_tool_calls": request.parallel_tool_calls, "max_tokens": request.max_output_tokens,
        "temperature": request.temperature, "top_p": request.top_p, "user": request.user,
    }
    body.update({name: value for name, value in fields.items() if value is not None})
    if request.streamed:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


# The chat fields a refusal of the translated request names, and the Responses fields they came from.
RESPONSES_PARAM = {
    "max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format",
    "prompt": "input",
}


def in_responses_terms(error: api_errors.ApiError) -> api_errors.ApiError:
    """A refusal of the chat request, naming the Responses field the caller sent instead."""
    param = error.param or ""
    head, _, rest = param.partition(".")
    if head in RESPONSES_PARAM:
        error.param = RESPONSES_PARAM[head] + (f".{rest}" if rest and head != "messages" else "")
        error.message = error.message.replace("'max_tokens'", "'max_output_tokens'").replace(
            "max_tokens lower", "max_output_tokens lower"
        )
    return error


def refusal_body(raw: bytes) -> bytes:
    """A chat refusal's body (OpenAI's error shape) with its ``param`` in Responses terms."""
    try:
        data = json.loads(raw)
        error = data["error"]
        param = error.get("param")
    except (ValueError, KeyError, TypeError, AttributeError):
        return raw
    if not isinstance(param, str):
        return raw
    renamed = in_responses_terms(api_errors.ApiError(str(error.get("message") or ""), param=param))
    return json.dumps(data | {"error": error | {"param": renamed.param, "message": renamed.message}}).encode()


# --- a chat completion as a Response ---------------------------------------------------------------


def new_response_id() -> str:
    return f"resp_{secrets.token_hex(24)}"


def item_id(prefix: str, response_id: str, index: int) -> str:
    """An output item's id, from the response's and the item's place in it (the stream and the whole
    answer give each item the same id)."""
    return f"{prefix}_{response_id.removeprefix('resp_')}{index:02d}"


def message_item(response_id: str, index: int, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id("msg", response_id, index), "type": "message", "role": "assistant", "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def function_call_item(response_id: str, index: int, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id("fc", response_id, index), "type": "function_call", "status": status, "call_id": call_id,
        "name": name, "arguments": arguments,
    }


def usage(chat_usage: object) -> dict[str, Any] | None:
    if not isinstance(chat_usage, dict):
        return None
    details = chat_usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    prompt, completion = int(chat_usage.get("prompt_tokens") or 0), int(chat_usage.get("completion_tokens") or 0)
    # cache_write_tokens: OpenAI's explicit prompt cache, which callers pay to fill; the prefix cache
    # here keeps what it computed by itself, at no charge.
    return {
        "input_tokens": prompt, "input_tokens_details": {"cached_tokens": int(cached or 0), "cache_write_tokens": 0},
        "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _echoed(request: ResponsesRequest) -> dict[str, Any]:
    """The request's parameters, as OpenAI's Response repeats them."""
    text = request.text.model_dump(exclude_none=True, by_alias=True) if request.text else {}
    tool_choice = request.tool_choice.model_dump() if isinstance(request.tool_choice, NamedFunction) else request.tool_choice
    return {
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "metadata": request.metadata or {}, "parallel_tool_calls": request.parallel_tool_calls is not False,
        "temperature": request.temperature, "top_p": request.top_p, "user": request.user,
        "tool_choice": tool_choice or "auto",
        "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or ()],
        "text": {"format": {"type": "text"}, **text},
        "store": False, "background": False, "previous_response_id": None, "reasoning": None, "truncation": "disabled",
    }


def response_shell(
    request: ResponsesRequest, response_id: str, created_at: int, model: str, status: str,
    output: list[dict[str, Any]] | None = None, chat_usage: object = None, completed_at: int | None = None,
) -> dict[str, Any]:
    """A Response object: ``status`` "in_progress", "completed" or "incomplete" (cut at max_output_tokens)."""
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "completed_at": completed_at, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model, "output": output or [], "usage": usage(chat_usage), **_echoed(request),
    }


def _status(finish_reason: object) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def response_object(request: ResponsesRequest, completion: dict[str, Any], response_id: str, now: int) -> dict[str, Any]:
    """The Response for a whole chat completion: its answer text as a message item (unless it only
    calls functions), then a function_call item for each call."""
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    status = _status(choice.get("finish_reason"))
    calls = message.get("tool_calls") or []
    output: list[dict[str, Any]] = []
    if message.get("content") or not calls:
        output.append(message_item(response_id, 0, message.get("content") or "", status))
    for call in calls:
        function = call.get("function") or {}
        output.append(function_call_item(
            response_id, len(output), str(call.get("id") or item_id("call", response_id, len(output))),
            str(function.get("name") or ""), str(function.get("arguments") or ""), "incomplete" if status == "incomplete" else "completed",
        ))
    created = int(completion.get("created") or now)
    model = str(completion.get("model") or request.model)
    return response_shell(request, response_id, created, model, status, output, completion.get("usage"), completed_at=now)


# --- a stream of chat completion chunks as a stream of Responses events -----------------------------

_EVENT_END = b"\n\n"
_DATA = b"data: "


@dataclass
class _OpenItem:
    """An output item the stream has added and not yet finished."""

    index: int
    kind: Literal["message", "function_call"]
    text: str = ""  # the message's text, or the call's arguments
    call_id: str = ""
    name: str = ""


@dataclass
class ResponseStream:
    """Feed the chat stream's bytes (``feed``) and relay what it returns; then relay ``end()``.

    Items are added as their first delta comes and finished when the next item starts or the stream
    ends; the last event, ``response.completed`` (or ``response.incomplete``, cut at
    max_output_tokens), holds the whole Response with its usage. An error event in the chat stream
    becomes the Responses ``error`` event, and ends it."""

    request: ResponsesRequest
    response_id: str
    created_at: int
    clock: Callable[[], int]
    _pending: bytes = b""
    _sequence: int = 0
    _model: str | None = None
    _open: _OpenItem | None = None
    _calls: dict[int, _OpenItem] = field(default_factory=dict)  # the chat stream's tool call index -> its item
    _done: list[dict[str, Any]] = field(default_factory=list)
    _finish_reason: object = None
    _usage: object = None
    _over: bool = False

    def feed(self, data: bytes) -> bytes:
        *events, self._pending = (self._pending + data).split(_EVENT_END)
        return b"".join(self._translated(event) for event in events)

    def end(self) -> bytes:
        """The closing events (unless an error ended the stream already)."""
        out = self._translated(self._pending) if self._pending.strip() else b""
        self._pending = b""
        if self._over:
            return out
        out += self._begin(self.request.model)
        status = _status(self._finish_reason)
        if self._open is None and not self._done:  # no text and no call: an empty answer, as a whole one has it
            out += self._start("message")
        out += self._finish_open(status)
        self._over = True
        final = response_shell(
            self.request, self.response_id, self.created_at, self._model or self.request.model, status,
            [dict(item) for item in self._done], self._usage, completed_at=self.clock(),
        )
        return out + self._event("response.completed" if status == "completed" else "response.incomplete", response=final)

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: %s\ndata: %s\n\n" % (kind.encode(), json.dumps(payload).encode())

    def _begin(self, model: str) -> bytes:
        if self._model is not None:
            return b""
        self._model = model
        shell = response_shell(self.request, self.response_id, self.created_at, model, "in_progress")
        return self._event("response.created", response=shell) + self._event("response.in_progress", response=shell)

    def _translated(self, event: bytes) -> bytes:
        event = event.strip()
        if self._over or not event.startswith(_DATA) or event == b"data: [DONE]":
            return b""
        try:
            chunk = json.loads(event[len(_DATA) :])
        except ValueError:
            return b""
        if not isinstance(chunk, dict):
            return b""
        out = self._begin(str(chunk.get("model") or self.request.model))
        if "error" in chunk or chunk.get("object") == "error":  # ours ({"error": {...}}), or an older vLLM's
            error = chunk.get("error")
            return out + self._error(error if isinstance(error, dict) else chunk)
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call_delta(call)
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
        return out

    def _error(self, error: dict[str, Any]) -> bytes:
        self._over = True
        code = error.get("code")
        return self._event(
            "error", code=code if isinstance(code, str) else str(error.get("type") or "server_error"),
            message=str(error.get("message") or "The model failed while answering."),
            param=error.get("param") if isinstance(error.get("param"), str) else None,
        )

    def _start(self, kind: Literal["message", "function_call"], call_id: str = "", name: str = "") -> bytes:
        out = self._finish_open("completed")
        index = len(self._done)
        self._open = _OpenItem(index, kind, call_id=call_id, name=name)
        if kind == "message":
            item = message_item(self.response_id, index, "", "in_progress")
            part = item["content"][0]
            item["content"] = []
            out += self._event("response.output_item.added", output_index=index, item=item)
            return out + self._event(
                "response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part
            )
        item = function_call_item(self.response_id, index, call_id, name, "", "in_progress")
        return out + self._event("response.output_item.added", output_index=index, item=item)

    def _text_delta(self, text: str) -> bytes:
        out = b"" if self._open is not None and self._open.kind == "message" else self._start("message")
        assert self._open is not None
        self._open.text += text
        return out + self._event(
            "response.output_text.delta", item_id=item_id("msg", self.response_id, self._open.index),
            output_index=self._open.index, content_index=0, delta=text, logprobs=[],
        )

    def _call_delta(self, call: dict[str, Any]) -> bytes:
        position = call.get("index", 0)
        function = call.get("function") or {}
        out = b""
        item = self._calls.get(position)
        if item is None:
            out += self._start("function_call", str(call.get("id") or ""), str(function.get("name") or ""))
            assert self._open is not None
            item = self._calls[position] = self._open
        elif item is not self._open:
            return b""  # a late delta for a call already finished: its item is out
        arguments = function.get("arguments")
        if not arguments:
            return out
        item.text += arguments
        return out + self._event(
            "response.function_call_arguments.delta", item_id=item_id("fc", self.response_id, item.index),
            output_index=item.index, delta=arguments,
        )

    def _finish_open(self, status: str) -> bytes:
        item, self._open = self._open, None
        if item is None:
            return b""
        if item.kind == "message":
            done = message_item(self.response_id, item.index, item.text, status)
            part = done["content"][0]
            out = self._event(
                "response.output_text.done", item_id=done["id"], output_index=item.index, content_index=0,
                text=item.text, logprobs=[],
            )
            out += self._event("response.content_part.done", item_id=done["id"], output_index=item.index, content_index=0, part=part)
        else:
            done = function_call_item(self.response_id, item.index, item.call_id, item.name, item.text, status)
            out = self._event(
                "response.function_call_arguments.done", item_id=done["id"], output_index=item.index,
                name=item.name, arguments=item.text,
            )
        self._done.append(done)
        return out + self._event("response.output_item.done", output_index=item.index, item=done)
