"""Function calling in training lines, as OpenAI's fine-tuning format writes it, checked and rendered.

A chat line may declare ``tools`` (``[{"type": "function", "function": {"name", "description"?,
"parameters"?}}]``) and hold assistant messages with ``tool_calls`` (``[{"id", "type": "function",
"function": {"name", "arguments": "<a JSON object, as a string>"}}]``, content null or absent) and
``tool`` messages answering them by ``tool_call_id``. Each check here returns what is wrong in words a
person can act on, so ``core.datasets`` reports it with the line's number.

``template_message`` hands a message to the chat template exactly as vLLM's server does for the same
request (arguments parsed into an object, a missing content as ""), so the trainer's tokens are the
prompt vLLM renders (``core.chat_tokens``; a test compares the two).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

# OpenAI's rule for a function's name.
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_FUNCTION_NAME_RULE = "1 to 64 letters, digits, '_' or '-'"

Tool = dict[str, Any]  # {"type": "function", "function": {"name", "description"?, "parameters"?}}
Problem = str | None


def checked_tools(raw: object, where: str = "tools") -> tuple[list[Tool] | None, Problem]:
    """A line's ``tools``: function tools with distinct, well-formed names and JSON Schema parameters."""
    if not isinstance(raw, list) or not all(isinstance(tool, dict) for tool in raw):
        return None, f"{where} must be a list of objects"
    tools, names = [], set()
    for index, tool in enumerate(raw):
        spec, problem = _checked_tool(tool, f"{where}[{index}]")
        if spec is None:
            return None, problem
        if spec["function"]["name"] in names:
            return None, f"{where}[{index}] declares {spec['function']['name']!r} a second time"
        names.add(spec["function"]["name"])
        tools.append(spec)
    return tools, None


def _checked_tool(tool: dict, where: str) -> tuple[Tool | None, Problem]:
    if tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
        return None, f'{where} must be {{"type": "function", "function": {{"name", "parameters"}}}}'
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        return None, f"{where}.function.name must be {_FUNCTION_NAME_RULE}"
    spec: dict[str, Any] = {"name": name}
    if function.get("description") is not None:
        if not isinstance(function["description"], str):
            return None, f"{where}.function.description must be a string"
        spec["description"] = function["description"]
    if function.get("parameters") is not None:
        problem = schema_problem(function["parameters"], f"{where}.function.parameters")
        if problem:
            return None, problem
        spec["parameters"] = function["parameters"]
    return {"type": "function", "function": spec}, None


def schema_problem(schema: object, where: str) -> Problem:
    """Why ``schema`` is not a JSON Schema of an object (checked against its metaschema, which is local:
    nothing is fetched, and the schema is only read, never run against anything here)."""
    if not isinstance(schema, dict):
        return f"{where} must be a JSON Schema object, like {{\"type\": \"object\", \"properties\": {{...}}}}"
    if schema.get("type", "object") != "object":
        return f"{where} must describe an object (\"type\": \"object\"): a function's arguments are named"
    text = json.dumps(schema, sort_keys=True)
    problem = _known_schema_problem(text) if len(text) <= _MAX_CACHED_SCHEMA_CHARS else _metaschema_problem(schema)
    return f"{where} is not a valid JSON Schema: {problem}" if problem else None


# Checking a schema against its metaschema costs about a millisecond, and agents send the same tools
# with every turn of a conversation: the verdicts on schemas seen lately are kept, by their text.
_MAX_CACHED_SCHEMA_CHARS = 16_384


@functools.lru_cache(maxsize=1024)
def _known_schema_problem(schema_text: str) -> Problem:
    return _metaschema_problem(json.loads(schema_text))


def _metaschema_problem(schema: dict) -> Problem:
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        place = "".join(f"[{part!r}]" for part in exc.path)
        return exc.message + (f" (at {place})" if place else "")
    return None


def request_tools_problem(tools: object, tool_choice: object, parallel_tool_calls: object) -> tuple[str, Problem]:
    """What is wrong with a chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, and the
    field at fault: checked before the request reaches an engine, in the words of a training line's check."""
    declared: set[str] = set()
    if tools is not None:
        checked, problem = checked_tools(tools)
        if checked is None:
            return "tools", problem
        declared = {tool["function"]["name"] for tool in checked}
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        return "parallel_tool_calls", "parallel_tool_calls must be true or false"
    return "tool_choice", _choice_problem(tool_choice, declared)


def _choice_problem(choice: object, declared: set[str]) -> Problem:
    if choice is None or choice in ("auto", "none"):
        return None
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if choice != "required" and not isinstance(name, str):
        return 'tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}'
    if not declared:
        return "tool_choice asks for a call, but the request declares no tools"
    if isinstance(name, str) and name not in declared:
        return f"tool_choice names {name!r}, which tools do not declare (declared: {', '.join(sorted(declared))})"
    return None


def checked_tool_calls(raw: object, where: str, declared: set[str], parallel: bool) -> tuple[list[dict] | None, Problem]:
    """An assistant message's ``tool_calls``: each names a declared function and gives its arguments as a
    string holding a JSON object."""
    if not isinstance(raw, list) or not raw:
        return None, f"{where} must be a non-empty list of calls"
    if len(raw) > 1 and not parallel:
        return None, f"{where} holds {len(raw)} calls, but the line sets parallel_tool_calls to false"
    calls = []
    for index, call in enumerate(raw):
        checked, problem = _checked_call(call, f"{where}[{index}]", declared)
        if checked is None:
            return None, problem
        calls.append(checked)
    return calls, None


def _checked_call(call: object, where: str, declared: set[str]) -> tuple[dict | None, Problem]:
    shape = '{"id", "type": "function", "function": {"name", "arguments"}}'
    if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(call.get("function"), dict):
        return None, f"{where} must be {shape}"
    call_id, function = call.get("id"), call["function"]
    if not isinstance(call_id, str) or not call_id.strip():
        return None, f"{where}.id must be a non-empty string (the tool message's tool_call_id answers it)"
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str):
        return None, f"{where}.function.name must be a string"
    if name not in declared:
        known = ", ".join(sorted(declared)) or "none"
        return None, f"{where} calls {name!r}, which the line's tools do not declare (declared: {known})"
    if not isinstance(arguments, str):
        return None, f"{where}.function.arguments must be a string holding a JSON object, like \"{{\\\"city\\\": \\\"Paris\\\"}}\""
    try:
        parsed = json.loads(arguments, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return None, f"{where}.function.arguments is not valid JSON: write a JSON object as a string"
    if not isinstance(parsed, dict):
        return None, f"{where}.function.arguments must hold a JSON object, not {type(parsed).__name__}"
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}, None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def template_message(message: dict) -> dict:
    """A checked message as vLLM's server hands it to the chat template: role and content ("" for an
    assistant's missing content), an assistant's ``tool_calls`` with their arguments parsed into objects
    (vLLM parses them, for templates that write them with ``tojson``), a tool message's ``tool_call_id``.
    Our ``weight`` is left out: some templates choke on extras."""
    rendered: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_calls"):
        rendered["tool_calls"] = [
            {**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}
            for call in message["tool_calls"]
        ]
    if message["role"] == "tool":
        rendered["tool_call_id"] = message["tool_call_id"]
    return rendered
