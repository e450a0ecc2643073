"""Function-calling training lines in OpenAI's format: checked by line, rendered as serving renders them,
and trained on the assistant's calls.

Whether vLLM renders the same tokens for the same conversation is tests/test_tools_served.py's question;
here, what the upload check and the trainer make of a line.
"""

from __future__ import annotations

import json

import pytest

from core.chat_tokens import tokenize_example
from core.datasets import PreferencePair, parse_dataset, parse_example
from finetuning.tokens import _tokenizer, default_model
from tests.tool_calling import WEATHER_TOOL, weather_call, weather_dataset, weather_line


@pytest.fixture(scope="module")
def tokenizer():
    return _tokenizer(default_model().id)  # the upload check's, and the trainer's (the same folder)


def trained_text(tokenizer, example) -> str:
    tokens = tokenize_example(tokenizer, example)
    return tokenizer.decode([token for token, trained in zip(tokens.input_ids, tokens.trained) if trained])


def test_a_function_calling_line_is_accepted_and_trains_on_the_call_and_the_reply_to_its_result(tokenizer):
    example, error = parse_example(json.dumps(weather_line("Paris", "Weather in {city}?", answered=1)), 2048)
    assert error is None and example.tools == [WEATHER_TOOL]
    assert trained_text(tokenizer, example) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
        "It is 12 °C and cloudy in Paris.<|im_end|>"
    )


def test_the_prompt_renders_the_declared_tools_and_the_tools_result_but_trains_on_neither(tokenizer):
    example, _ = parse_example(json.dumps(weather_line("Paris", "Weather in {city}?", answered=1)), 2048)
    tokens = tokenize_example(tokenizer, example)
    untrained = tokenizer.decode([token for token, trained in zip(tokens.input_ids, tokens.trained) if not trained])
    assert '"name": "get_weather", "description": "Get the current weather in a city"' in untrained
    assert '<tool_response>\n{"city": "Paris", "temperature_c": 12, "sky": "cloudy"}\n</tool_response>' in untrained


def test_a_line_without_tools_renders_as_before_the_template_rendered_tools(tokenizer):
    """The shipped template renders a plain conversation exactly as SmolLM2's own did: adapters trained
    before it see the prompts they were trained on."""
    example, _ = parse_example(json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}))
    text = tokenizer.decode(tokenize_example(tokenizer, example).input_ids)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
    )


def test_parallel_calls_are_rendered_one_after_the_other_and_all_trained(tokenizer):
    line = weather_line("Paris", "Weather in {city} and Rome?")
    line["messages"][1]["tool_calls"].append(weather_call("Rome", "call_2"))
    line["parallel_tool_calls"] = True
    example, error = parse_example(json.dumps(line), 2048)
    assert error is None
    assert trained_text(tokenizer, example).count("<tool_call>") == 2


def test_a_fifty_line_function_calling_file_passes_the_upload_check():
    dataset = parse_dataset(weather_dataset(48), min_examples=10)
    assert dataset.ok and dataset.example_count == 48, dataset.errors


def _with(line: dict, **changes) -> dict:
    return {**line, **changes}


_LINE = weather_line("Paris", "Weather in {city}?", answered=1)
_QUESTION, _CALL, _RESULT, _REPLY = _LINE["messages"]


def _call_with(**function) -> dict:
    call = weather_call("Paris")
    return {**_CALL, "tool_calls": [{**call, "function": {**call["function"], **function}}]}


@pytest.mark.parametrize(
    "line, expected",
    [
        (_with(_LINE, messages=[_QUESTION, _call_with(arguments="city=Paris")]), "arguments is not valid JSON"),
        (_with(_LINE, messages=[_QUESTION, _call_with(arguments='["Paris"]')]), "arguments must hold a JSON object"),
        (_with(_LINE, messages=[_QUESTION, _call_with(arguments={"city": "Paris"})]), "arguments must be a string"),
        (_with(_LINE, messages=[_QUESTION, _call_with(arguments='{"x": NaN}')]), "arguments is not valid JSON"),
        (_with(_LINE, messages=[_QUESTION, _call_with(name="get_time")]), "calls 'get_time', which the line's tools do not declare"),
        ({"messages": [_QUESTION, _CALL]}, "calls 'get_weather', which the line's tools do not declare (declared: none)"),
        (_with(_LINE, messages=[_QUESTION, _CALL, {**_RESULT, "tool_call_id": "call_9"}, _REPLY]), "'call_9' answers no call"),
        (_with(_LINE, messages=[_QUESTION, _CALL, _RESULT, _RESULT, _REPLY]), "'call_1' answers no call"),
        (_with(_LINE, messages=[_QUESTION, {"role": "tool", "tool_call_id": "call_1", "content": "x"}]), "answers no call"),
        (_with(_LINE, tools=[{"type": "function", "function": {"name": "get_weather", "parameters": "city"}}]),
         "tools[0].function.parameters must be a JSON Schema object"),
        (_with(_LINE, tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "array"}}}]),
         "must describe an object"),
        (_with(_LINE, tools=[{"type": "function", "function": {"name": "get_weather",
                                                               "parameters": {"type": "object", "required": "city"}}}]),
         "is not a valid JSON Schema"),
        (_with(_LINE, tools=[{"type": "function", "function": {"name": "get weather"}}]), "function.name must be"),
        (_with(_LINE, tools=[WEATHER_TOOL, WEATHER_TOOL]), "declares 'get_weather' a second time"),
        (_with(_LINE, tools="get_weather"), "tools must be a list of objects"),
        (_with(_LINE, parallel_tool_calls="no"), "parallel_tool_calls must be true or false"),
        (_with(_LINE, messages=[_QUESTION, {**_CALL, "tool_calls": [weather_call("A"), weather_call("B", "call_2")]}]),
         "but the line sets parallel_tool_calls to false"),
        (_with(_LINE, messages=[_QUESTION, {**_CALL, "tool_calls": []}]), "tool_calls must be a non-empty list"),
        (_with(_LINE, messages=[{**_QUESTION, "tool_calls": [weather_call("Paris")]}, _CALL]), "only allowed on assistant"),
    ],
)
def test_a_bad_function_calling_line_is_refused_with_its_line_number(line, expected):
    good = json.dumps(weather_line("Rome", "Weather in {city}?")).encode()
    dataset = parse_dataset(good + b"\n" + json.dumps(line).encode() + b"\n" + good, min_examples=1)
    assert [error.line for error in dataset.errors] == [2], dataset.errors
    assert expected in dataset.errors[0].message, dataset.errors[0].message


def test_a_preference_pair_carries_its_inputs_tools_into_both_conversations(tokenizer):
    line = {
        "input": {"messages": [_QUESTION], "tools": [WEATHER_TOOL]},
        "preferred_output": [_CALL],
        "non_preferred_output": [{"role": "assistant", "content": "I cannot look that up."}],
    }
    pair, error = parse_example(json.dumps(line), 2048)
    assert error is None and isinstance(pair, PreferencePair)
    assert pair.chosen.tools == pair.rejected.tools == [WEATHER_TOOL]
    assert trained_text(tokenizer, pair.chosen).startswith("<tool_call>")
    bad = {**line, "input": {**line["input"], "tools": [{"type": "function", "function": {"name": "x y"}}]}}
    assert "input.tools[0].function.name" in parse_example(json.dumps(bad), 2048)[1]


def test_a_conversation_with_tools_is_refused_past_its_cap_of_replies_rather_than_checked_slowly():
    turns = [_QUESTION] + [_CALL, _RESULT] * 70
    calls = [{**message, "tool_calls": [weather_call("Paris", f"call_{i}")]} if message is _CALL else message
             for i, message in enumerate(turns)]
    for i in range(1, len(calls), 2):
        calls[i + 1] = {**_RESULT, "tool_call_id": calls[i]["tool_calls"][0]["id"]}
    _, error = parse_example(json.dumps(_with(_LINE, messages=calls)), 2048)
    assert error is not None and "70 assistant messages in a conversation with tools, more than 64" in error
