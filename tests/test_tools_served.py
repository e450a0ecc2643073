"""Tools on the real engine, through the gateway, with the official client and the shapes of OpenAI's
function calling guide: a named or ``required`` choice gives a call valid against the tool's schema
(the base model has never been taught to call tools), streamed as ``delta.tool_calls`` pieces the
guide's own loop assembles; ``none`` answers text; a second turn carrying the tool's result is
answered; a fine-tune, a mix and a batch take tools as the base model does. And the trainer renders
a tool conversation token for token as the server does, so what is trained is what is served."""

# ruff: noqa: F811 (pytest fixtures are imported from tests.inference_fixtures, then named as arguments)
from __future__ import annotations

import json

import jsonschema
import pytest

from tests.inference_fixtures import (  # noqa: F401 (fixtures)
    BASE,
    alice,
    gateway,
    internal_headers,
    make_adapter,
    publish_fine_tuned_model,
)
from tests.served_answers import assert_trained_as_served
from tests.tool_calling import GUIDE_GET_WEATHER, TWO_CITIES, assembled_tool_calls

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

# The guide's example tool and question, as written there.
GET_WEATHER = {"type": "function", "function": GUIDE_GET_WEATHER}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# Greedy, with room for a city and country: sampled at temperature 1, the untaught base model once
# wrote a location longer than 40 tokens, and a call cut short is no call.
CALL = {"temperature": 0, "max_tokens": 100}


def test_the_trainer_renders_a_tool_conversation_token_for_token_as_the_server_does(inference_pool):
    from django.conf import settings

    assert_trained_as_served(inference_pool, BASE, settings.CONFIG.data_dir / "models" / BASE)


def test_a_named_or_required_choice_calls_the_tool_with_arguments_its_schema_accepts(alice):
    client = alice.client
    for choice in (NAMED, "required"):
        completion = client.chat.completions.create(
            model=BASE, messages=QUESTION, tools=[GET_WEATHER], tool_choice=choice, **CALL
        )
        message = completion.choices[0].message
        (call,) = message.tool_calls or [None]
        assert call is not None, completion
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), GET_WEATHER["function"]["parameters"])
    assert completion.choices[0].finish_reason == "tool_calls"  # required: the model chose to call

    answered = client.chat.completions.create(model=BASE, messages=QUESTION, tools=[GET_WEATHER], tool_choice="none", max_tokens=8)
    assert answered.choices[0].message.content and not answered.choices[0].message.tool_calls


def test_a_streamed_call_arrives_as_pieces_the_guides_loop_assembles(alice):
    stream = alice.client.chat.completions.create(
        model=BASE, messages=QUESTION, tools=[GET_WEATHER], tool_choice=NAMED, stream=True, **CALL
    )
    (call,) = assembled_tool_calls(stream)
    assert call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), GET_WEATHER["function"]["parameters"])


def test_the_tools_result_makes_a_second_turn_that_is_answered(alice):
    client = alice.client
    first = client.chat.completions.create(model=BASE, messages=QUESTION, tools=[GET_WEATHER], tool_choice=NAMED, **CALL)
    call = first.choices[0].message.tool_calls[0]
    messages = [*QUESTION, first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "14 degrees Celsius"}]
    second = client.chat.completions.create(model=BASE, messages=messages, tools=[GET_WEATHER], max_tokens=16)
    assert second.choices[0].message.content or second.choices[0].message.tool_calls
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result were read


def test_a_fine_tune_and_a_mix_take_tools_as_the_base_model_does(alice, make_adapter):
    fine_tune = publish_fine_tuned_model(alice, "tools-adapter", make_adapter(seed=11))
    for model, extra in ((fine_tune, {}), (BASE, {"adapters": [{"model": fine_tune, "scale": 0.5}]})):
        completion = alice.client.chat.completions.create(
            model=model, messages=QUESTION, tools=[TWO_CITIES], tool_choice="required", max_tokens=60, extra_body=extra
        )
        assert completion.choices[0].message.tool_calls, completion
        (call,) = completion.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), TWO_CITIES["function"]["parameters"])
