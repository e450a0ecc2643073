"""The gateway's checks of a request's tools, before it reaches an engine: well-formed tools go to the
pool as they came; a malformed tool, choice or flag is a 400 naming the field and saying what to
write; tools asked of a model whose chat template renders none are a 400 naming the model, on the
chat and the Responses paths alike; the tools' text counts toward the prompt's cap. The pool is
test_request_limits' stand-in that records what it receives; a refused request reaches it not at all."""

# ruff: noqa: F811 (pytest fixtures are imported, then named as arguments)
from __future__ import annotations

import dataclasses
import json

import pytest

from tests.helpers import anyio_backend  # noqa: F401
from tests.personas import alice  # noqa: F401 (fixtures)
from tests.recording_pool import _bearer, _chat, _error, _limits, pool, web  # noqa: F401
from tests.tool_calling import WEATHER_TOOL

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.anyio]

NAMED = {"type": "function", "function": {"name": "get_weather"}}
NAMELESS = {"type": "function", "function": {"description": "no name"}}


async def test_it_forwards_tools_and_a_choice_as_they_came(web, pool, alice):
    sent = _chat(tools=[WEATHER_TOOL], tool_choice=NAMED, parallel_tool_calls=False)
    response = await web.post("/v1/chat/completions", json=sent, headers=_bearer(alice))
    assert response.status_code == 200, response.text
    forwarded = json.loads(pool.bodies[0])
    assert {name: value for name, value in forwarded.items() if name != "cache_salt"} == sent


REFUSED = {
    "tools not a list": ({"tools": {"get_weather": {}}}, "tools", "tools must be a list of objects"),
    "a tool without a name": ({"tools": [NAMELESS]}, "tools", "tools[0].function.name must be 1 to 64 letters"),
    "a name with a space": (
        {"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools", "function.name must be",
    ),
    "a built-in tool": ({"tools": [{"type": "web_search"}]}, "tools", '"type": "function"'),
    "parameters not a schema": (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}]},
        "tools", "tools[0].function.parameters is not a valid JSON Schema",
    ),
    "a function declared twice": ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools", "declares 'get_weather' a second time"),
    "a choice of an undeclared function": (
        {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
        "tool_choice", "names 'get_time', which tools do not declare (declared: get_weather)",
    ),
    "a call required without tools": ({"tool_choice": "required"}, "tool_choice", "declares no tools"),
    "a choice of another word": ({"tools": [WEATHER_TOOL], "tool_choice": "always"}, "tool_choice", '"auto", "none"'),
    "parallel_tool_calls a string": (
        {"tools": [WEATHER_TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "must be true or false",
    ),
}


@pytest.mark.parametrize(("fields", "param", "message"), REFUSED.values(), ids=REFUSED.keys())
async def test_it_refuses_malformed_tools_naming_the_field(web, pool, alice, fields, param, message):
    response = await web.post("/v1/chat/completions", json=_chat(**fields), headers=_bearer(alice))
    error = _error(response)
    assert response.status_code == 400 and error["param"] == param and message in error["message"], error
    assert pool.bodies == []


async def test_tools_for_a_model_whose_template_renders_none_are_refused_on_chat_and_responses(web, pool, alice, settings):
    catalog = settings.MODEL_CATALOG
    settings.MODEL_CATALOG = dataclasses.replace(catalog, models=(dataclasses.replace(catalog.models[0], tools=None),))
    chat = await web.post("/v1/chat/completions", json=_chat(tools=[WEATHER_TOOL]), headers=_bearer(alice))
    responses_tool = {"type": "function", **WEATHER_TOOL["function"]}
    body = {"model": catalog.models[0].id, "input": "Weather in Oslo?", "tools": [responses_tool]}
    responses = await web.post("/v1/responses", json=body, headers=_bearer(alice))
    for response in (chat, responses):
        error = _error(response)
        assert response.status_code == 400 and error["code"] == "tools_not_supported" and error["param"] == "tools"
        assert catalog.models[0].id in error["message"]
    assert pool.bodies == []
    plain = await web.post("/v1/chat/completions", json=_chat(), headers=_bearer(alice))
    assert plain.status_code == 200  # the model still answers without tools


async def test_the_tools_text_counts_toward_the_prompts_cap(web, pool, alice, settings):
    _limits(settings, prompt_chars=400)
    described = {"type": "function", "function": {**WEATHER_TOOL["function"], "description": "x" * 400}}
    response = await web.post("/v1/chat/completions", json=_chat(tools=[described]), headers=_bearer(alice))
    error = _error(response)
    assert response.status_code == 400 and error["code"] == "limit_exceeded" and "'messages' and 'tools'" in error["message"]
    assert pool.bodies == []


def test_a_streamed_calls_first_piece_gets_empty_arguments_and_other_events_pass_byte_for_byte():
    from answering.tool_call_pieces import with_openai_tool_call_pieces

    text = b'data: {"choices":[{"delta":{"content":"Hi"},"index":0}]}\n\n'
    assert with_openai_tool_call_pieces(text) is text
    opening = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather"}}
    piece = {"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}
    events = b"".join(
        b"data: " + json.dumps({"choices": [{"delta": {"tool_calls": [call]}, "index": 0}]}).encode() + b"\n\n"
        for call in (opening, piece)
    ) + b"data: [DONE]\n\n"
    shaped = with_openai_tool_call_pieces(events).split(b"\n\n")
    first = json.loads(shaped[0].removeprefix(b"data: "))["choices"][0]["delta"]["tool_calls"][0]
    assert first["function"] == {"name": "get_weather", "arguments": ""} and first["id"] == "call_1"
    assert shaped[1:] == events.split(b"\n\n")[1:]  # a piece with arguments, [DONE] and the end as they came
