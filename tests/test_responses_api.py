"""OpenAI's Responses API on the real engine, through the gateway as ``bin/run`` starts it, with the
official client and OpenAI's own documented examples (only ``max_output_tokens`` added, to keep the
shared engine's time short): text, instructions, a function call and its output's second turn,
structured output, both kinds of stream; usage counted as chat's is; another organization's
fine-tune and the fields not offered refused as the API's errors."""

# ruff: noqa: F811 (pytest fixtures are imported from tests.inference_fixtures, then named as arguments)
from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest

from tests.inference_fixtures import BASE, alice, charlie, gateway, register_fine_tuned_model  # noqa: F401 (fixtures)
from tests.processes import wait_until
from tests.served_answers import usage_reported
from tests.tool_calling import GUIDE_GET_WEATHER

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

GET_WEATHER = {"type": "function", **GUIDE_GET_WEATHER}  # the Responses API's flat shape
NAMED = {"type": "function", "name": "get_weather"}  # forces a valid call even from the base model


def test_the_documented_text_examples_answer_and_count_their_tokens_as_chat_does(alice, gateway):
    client, started = alice.client, int(time.time())
    response = client.responses.create(
        model=BASE, input="Tell me a three sentence bedtime story about a unicorn.", max_output_tokens=16
    )
    assert response.id.startswith("resp_") and response.object == "response" and response.model == BASE
    assert response.output_text and response.output[0].type == "message"
    assert response.status == "incomplete" or response.usage.output_tokens < 16  # cut at max_output_tokens, or ended
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens" and response.usage.output_tokens == 16

    pirate = client.responses.create(
        model=BASE, instructions="You are a coding assistant that talks like a pirate.",
        input="How do I check if a Python object is an instance of a class?", max_output_tokens=12, temperature=0,
    )
    assert pirate.instructions.startswith("You are a coding assistant") and pirate.temperature == 0
    chat = client.chat.completions.create(
        model=BASE, max_tokens=12, temperature=0, messages=[
            {"role": "system", "content": "You are a coding assistant that talks like a pirate."},
            {"role": "user", "content": "How do I check if a Python object is an instance of a class?"},
        ],
    )
    assert pirate.output_text == chat.choices[0].message.content  # the same prompt, greedy: the same answer
    assert (pirate.usage.input_tokens, pirate.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)

    wait_until(lambda: usage_reported(gateway, alice.api_key, started, 3), 30, "the gateway's usage flush")
    counted = usage_reported(gateway, alice.api_key, started, 3)
    answers = (response.usage, pirate.usage)
    assert counted["input_tokens"] == sum(usage.input_tokens for usage in answers) + chat.usage.prompt_tokens
    assert counted["output_tokens"] == sum(usage.output_tokens for usage in answers) + chat.usage.completion_tokens


def test_a_named_tool_choice_calls_the_function_and_its_output_makes_the_second_turn(alice):
    client = alice.client
    input_messages: list = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    response = client.responses.create(
        model=BASE, input=input_messages, tools=[GET_WEATHER], tool_choice=NAMED, max_output_tokens=40
    )
    call = response.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), GET_WEATHER["parameters"])
    assert response.tool_choice.name == "get_weather" and response.tools[0].name == "get_weather"

    input_messages.append(call)  # as the guide does: the call, then its result
    input_messages.append({"type": "function_call_output", "call_id": call.call_id, "output": "14 degrees Celsius"})
    second = client.responses.create(model=BASE, input=input_messages, tools=[GET_WEATHER], max_output_tokens=12)
    assert second.output and second.usage.input_tokens > response.usage.input_tokens


def test_structured_output_follows_the_json_schema_of_text_format(alice):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "date": {"type": "string"}, "participants": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "date", "participants"],
        "additionalProperties": False,
    }
    response = alice.client.responses.create(
        model=BASE,
        input=[
            {"role": "system", "content": "Extract the event information."},
            {"role": "user", "content": "Alice and Bob are going to a science fair on Friday."},
        ],
        text={"format": {"type": "json_schema", "name": "calendar_event", "schema": schema, "strict": True}},
        max_output_tokens=64, temperature=0,
    )
    assert response.text.format.type == "json_schema" and response.text.format.name == "calendar_event"
    assert response.status == "completed", response.output_text
    jsonschema.validate(json.loads(response.output_text), schema)


def test_both_kinds_of_stream_give_openai_s_events_and_the_whole_response(alice):
    client = alice.client
    events = list(client.responses.create(model=BASE, input="Say 'double bubble bath' ten times fast.", stream=True, max_output_tokens=8))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == final.output_text
    assert final.usage.output_tokens == kinds.count("response.output_text.delta") and final.usage.input_tokens > 0

    with client.responses.stream(
        model=BASE, input="What is the weather like in Paris today?", tools=[GET_WEATHER], tool_choice=NAMED, max_output_tokens=40
    ) as stream:  # the helper checks each event against what it has accumulated
        helper_kinds = [event.type for event in stream]
        whole = stream.get_final_response()
    assert "response.function_call_arguments.delta" in helper_kinds and whole.status == "completed"
    call = whole.output[0]
    assert call.type == "function_call" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), GET_WEATHER["parameters"])


def test_another_organizations_fine_tune_is_not_found_and_what_is_not_offered_is_refused(alice, charlie):
    theirs = register_fine_tuned_model(alice, "acme-responses")
    with pytest.raises(openai.NotFoundError) as missing:
        charlie.client.responses.create(model=theirs, input="hi", max_output_tokens=4)
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
    refused = {
        "store": {"store": True},
        "previous_response_id": {"previous_response_id": "resp_123"},
        "tools.0": {"tools": [{"type": "web_search_preview"}]},
        "input.0.content": {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
        "max_output_tokens": {"max_output_tokens": 10**7},
    }
    for param, fields in refused.items():
        with pytest.raises(openai.BadRequestError) as error:
            alice.client.responses.create(**({"model": BASE, "input": "hi"} | fields))
        assert error.value.body["param"] == param, error.value.body
    with pytest.raises(openai.NotFoundError) as stored:
        alice.client.responses.retrieve("resp_123")
    assert "not stored" in stored.value.message
