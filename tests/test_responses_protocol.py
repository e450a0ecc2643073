"""The Responses API as a translation of chat completions (``core.responses_protocol``), engine-free:
a Responses request into the chat body it means, a chat completion into a Response, a chat stream
into the Responses events. What comes out is read back with the installed ``openai`` package's own
types and its stream accumulator, so a shape it would not take fails here."""

from __future__ import annotations

import json

import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from core import api_errors
from core import responses_protocol as protocol

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function", "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
RESPONSE_ID = "resp_" + "ab" * 24


def chat(body: dict) -> dict:
    return protocol.chat_body(protocol.request_from({"model": MODEL} | body))


def refusal(body: dict | bytes) -> api_errors.ApiError:
    with pytest.raises(api_errors.ApiError) as refused:
        if isinstance(body, bytes):
            protocol.parse_request(body)
        else:
            protocol.request_from({"model": MODEL, "input": "hi"} | body)
    assert refused.value.status == 400
    return refused.value


# --- requests ----------------------------------------------------------------------------------------


def test_it_turns_a_string_input_and_instructions_into_a_system_then_a_user_message():
    body = chat({"input": "Tell me a three sentence bedtime story about a unicorn.", "instructions": "Talk like a pirate."})
    assert body == {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Talk like a pirate."},
            {"role": "user", "content": "Tell me a three sentence bedtime story about a unicorn."},
        ],
    }


def test_it_reads_messages_with_or_without_a_type_and_joins_their_text_parts():
    body = chat({"input": [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "ab", "annotations": []}]},
        {"role": "system", "content": "Still brief."},
    ]})
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},  # chat templates know no developer role
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "ab"},
        {"role": "system", "content": "Still brief."},
    ]


def test_it_turns_function_calls_and_their_outputs_into_assistant_tool_calls_and_tool_messages():
    body = chat({"tools": [WEATHER], "input": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}', "id": "fc_2"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "function_call", "call_id": "call_3", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
    ]})
    call = lambda n, city: {  # noqa: E731
        "id": f"call_{n}", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }
    assert body["messages"][1:] == [
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call(1, "Paris"), call(2, "Rome")]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "assistant", "content": None, "tool_calls": [call(3, "Oslo")]},
    ]


def test_it_nests_flat_function_tools_as_chat_has_them_and_translates_tool_choice():
    body = chat({"input": "hi", "tools": [WEATHER | {"strict": True}], "tool_choice": {"type": "function", "name": "get_weather"},
                 "parallel_tool_calls": False})
    assert body["tools"] == [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"} | {"strict": True}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["parallel_tool_calls"] is False
    for mode in ("auto", "none", "required"):
        assert chat({"input": "hi", "tools": [WEATHER], "tool_choice": mode})["tool_choice"] == mode


@pytest.mark.parametrize(
    ("format", "response_format"),
    [
        ({"type": "text"}, {"type": "text"}),
        ({"type": "json_object"}, {"type": "json_object"}),
        (
            {"type": "json_schema", "name": "pet", "schema": {"type": "object"}, "strict": True},
            {"type": "json_schema", "json_schema": {"name": "pet", "schema": {"type": "object"}, "strict": True}},
        ),
    ],
)
def test_it_turns_text_format_into_response_format(format, response_format):
    assert chat({"input": "hi", "text": {"format": format}})["response_format"] == response_format


def test_it_renames_sampling_fields_keeps_metadata_to_echo_and_asks_a_stream_for_its_usage():
    body = chat({"input": "hi", "max_output_tokens": 16, "temperature": 0, "top_p": 0.5, "user": "u1",
                 "metadata": {"k": "v"}, "stream": True, "store": False, "background": False})
    assert body == {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "temperature": 0,
        "top_p": 0.5, "user": "u1", "stream": True, "stream_options": {"include_usage": True},
    }


def test_it_passes_a_mix_on_as_chat_takes_it():
    mix = [{"model": f"{MODEL}:a", "scale": 0.5}]
    assert chat({"input": "hi", "adapters": mix})["adapters"] == mix


@pytest.mark.parametrize(
    ("fields", "param", "said"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
        ({"store": True}, "store", "not stored"),
        ({"conversation": "conv_1"}, "conversation", "not stored"),
        ({"background": True}, "background", "while the request waits"),
        ({"include": ["reasoning.encrypted_content"]}, "include", "include"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt"),
        ({"reasoning": {"effort": "low"}}, "reasoning", "reasoning"),
        ({"truncation": "auto"}, "truncation", "never truncated"),
        ({"text": {"verbosity": "low"}}, "text.verbosity", "verbosity"),
        ({"tools": [{"type": "web_search_preview"}]}, "tools.0", "'web_search_preview' tools are not offered"),
        ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["vs"]}]}, "tools.1", "'file_search'"),
        ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools.0", "'code_interpreter'"),
        ({"tools": [{"type": "computer_use_preview"}]}, "tools.0", "'computer_use_preview'"),
        ({"tools": [{"type": "image_generation"}]}, "tools.0", "'image_generation'"),
        ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools.0", "'mcp'"),
        ({"tools": [{"type": "local_shell"}]}, "tools.0", "'local_shell'"),
        ({"tools": [{"type": "custom", "name": "x"}]}, "tools.0", "'custom'"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "'auto', 'none', 'required'"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x"}]}]}, "input.0.content", "'input_image'"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]}, "input.0.content", "'input_file'"),
        ({"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, "input.0.content", "'input_audio'"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0", "'item_reference' items are not offered"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input.0.arguments", "required"),
        ({"input": [{"role": "user", "content": "x", "color": "red"}]}, "input.0.color", "not permitted"),
        ({"input": []}, "input", "at least one item"),
        ({"temperature": "1"}, "temperature", "number"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"metadata": {"k": "v" * 513}}, "metadata", "512"),
        ({"text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema", "required"),
        ({"seed": 1}, "seed", "Unrecognized request argument"),
        ({"messages": []}, "messages", "Unrecognized request argument"),
    ],
)
def test_it_refuses_what_it_does_not_offer_naming_the_field(fields, param, said):
    error = refusal(fields)
    assert error.param == param and said in error.message


@pytest.mark.parametrize(
    ("raw", "param"),
    [(b'{"model": "m", "input": "hi", "temperature": NaN}', "temperature"),
     (b'{"model": "m", "input": "hi", "max_output_tokens": 9223372036854775808}', "max_output_tokens"),
     (b'{"model": "m", "input": ' + b"[" * 100 + b"]" * 100 + b"}", "input"),
     (b'["model"]', None)],
)
def test_it_reads_the_body_as_every_body_is_read(raw, param):
    assert refusal(raw).param == param


def test_it_names_the_responses_field_in_a_refusal_of_the_chat_request():
    error = protocol.in_responses_terms(api_errors.over_limit("max_tokens", "'max_tokens'", 9000, 4096, "MAX_COMPLETION_TOKENS"))
    assert error.param == "max_output_tokens" and "'max_output_tokens' is 9,000" in error.message
    body = json.loads(protocol.refusal_body(b'{"error": {"message": "too long", "type": "x", "param": "messages", "code": "c"}}'))
    assert body["error"]["param"] == "input" and body["error"]["code"] == "c"
    assert protocol.refusal_body(b"not json") == b"not json"


# --- whole answers -------------------------------------------------------------------------------------


def completion(message: dict, finish_reason: str = "stop") -> dict:
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": f"{MODEL}:bot@r2",
        "choices": [{"index": 0, "message": {"role": "assistant"} | message, "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17, "prompt_tokens_details": {"cached_tokens": 4}},
    }


def test_it_answers_a_chat_completion_as_a_response_the_openai_client_reads():
    request = protocol.request_from({"model": MODEL, "input": "hi", "instructions": "Be kind.", "metadata": {"k": "v"},
                                     "temperature": 0.5, "max_output_tokens": 32})
    body = protocol.response_object(request, completion({"content": "Hello there."}), RESPONSE_ID, 1700000005)
    response = Response.model_validate(body)
    assert response.id == RESPONSE_ID and response.object == "response" and response.status == "completed"
    assert response.model == f"{MODEL}:bot@r2" and response.created_at == 1700000000
    assert response.output_text == "Hello there."
    assert [item.type for item in response.output] == ["message"] and response.output[0].id.startswith("msg_")
    assert response.usage is not None and response.usage.input_tokens == 12 and response.usage.output_tokens == 5
    assert response.usage.total_tokens == 17 and response.usage.input_tokens_details.cached_tokens == 4
    assert (response.instructions, response.metadata, response.temperature, response.max_output_tokens) == ("Be kind.", {"k": "v"}, 0.5, 32)
    assert (response.tool_choice, response.tools, response.parallel_tool_calls) == ("auto", [], True)
    assert response.text is not None and response.text.format is not None and response.text.format.type == "text"


def test_it_marks_an_answer_cut_at_max_output_tokens_incomplete():
    request = protocol.request_from({"model": MODEL, "input": "hi", "max_output_tokens": 5})
    response = Response.model_validate(protocol.response_object(request, completion({"content": "Once upon"}, "length"), RESPONSE_ID, 1))
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens" and response.output[0].status == "incomplete"


def test_it_answers_tool_calls_as_function_call_items_carrying_the_chat_call_ids():
    request = protocol.request_from({"model": MODEL, "input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}})
    calls = [
        {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "chatcmpl-tool-2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
    ]
    response = Response.model_validate(protocol.response_object(request, completion({"content": "", "tool_calls": calls}, "tool_calls"), RESPONSE_ID, 1))
    assert [item.type for item in response.output] == ["function_call", "function_call"]  # no empty message
    first = response.output[0]
    assert first.type == "function_call" and first.call_id == "chatcmpl-tool-1" and first.name == "get_weather"
    assert json.loads(first.arguments) == {"city": "Paris"} and first.status == "completed" and first.id.startswith("fc_")
    assert len({item.id for item in response.output}) == 2
    assert response.tool_choice.type == "function" and response.tool_choice.name == "get_weather"
    assert response.tools[0].type == "function" and response.tools[0].name == "get_weather"


def test_it_keeps_answer_text_beside_the_calls_it_came_with():
    request = protocol.request_from({"model": MODEL, "input": "hi", "tools": [WEATHER]})
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    response = Response.model_validate(protocol.response_object(request, completion({"content": "Checking.", "tool_calls": [call]}), RESPONSE_ID, 1))
    assert [item.type for item in response.output] == ["message", "function_call"] and response.output_text == "Checking."


# --- streams -------------------------------------------------------------------------------------------


def chunk(delta: dict | None = None, finish_reason: str | None = None, **more) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
    return b"data: " + json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000,
                                   "model": f"{MODEL}:bot@r2", "choices": choices, **more}).encode() + b"\n\n"


USAGE = chunk(usage={"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12})


def streamed(request_fields: dict, *parts: bytes, piece: int = 0) -> list[dict]:
    """The Responses events for the chat stream ``parts`` (cut into ``piece``-byte feeds if set)."""
    request = protocol.request_from({"model": MODEL, "input": "hi", "stream": True} | request_fields)
    stream = protocol.ResponseStream(request, RESPONSE_ID, 1700000000, clock=lambda: 1700000009)
    data = b"".join(parts)
    feeds = [data[i : i + piece] for i in range(0, len(data), piece)] if piece else [data]
    raw = b"".join(stream.feed(feed) for feed in feeds) + stream.end()
    events = []
    for block in raw.split(b"\n\n")[:-1]:
        name, payload = block.split(b"\n")
        event = json.loads(payload.removeprefix(b"data: "))
        assert name == b"event: " + event["type"].encode()
        events.append(event)
    assert raw.endswith(b"\n\n") and [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


def accumulated(events: list[dict], tools: list | None = None) -> Response:
    """What the openai client's ``responses.stream()`` helper makes of the events (it checks their
    consistency as it goes), and its final response."""
    state = ResponseStreamState(input_tools=tools or [], text_format=omit)
    for event in events:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))  # type: ignore[arg-type]
    assert state._completed_response is not None, "no response.completed"
    return state._completed_response


def test_it_streams_text_as_openai_s_events_in_their_order():
    events = streamed({}, chunk({"role": "assistant", "content": ""}), chunk({"content": "Once"}), chunk({"content": " upon"}),
                      chunk({}, "stop"), USAGE, b"data: [DONE]\n\n")
    assert [event["type"] for event in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["id"] == RESPONSE_ID
    final = accumulated(events)
    assert final.output_text == "Once upon" and final.status == "completed" and final.completed_at == 1700000009
    assert final.usage is not None and (final.usage.input_tokens, final.usage.output_tokens, final.usage.total_tokens) == (9, 3, 12)
    assert events[6]["text"] == "Once upon" and events[8]["item"]["status"] == "completed"


def test_it_reads_events_cut_anywhere_between_feeds():
    parts = (chunk({"content": "Héllo"}), chunk({"content": " wörld"}), chunk({}, "stop"), USAGE, b"data: [DONE]\n\n")
    whole = streamed({}, *parts)
    assert streamed({}, *parts, piece=7) == whole and accumulated(whole).output_text == "Héllo wörld"


def test_it_streams_tool_calls_as_function_call_items_with_their_argument_deltas():
    tools = [WEATHER]
    events = streamed(
        {"tools": tools, "tool_choice": {"type": "function", "name": "get_weather"}},
        chunk({"role": "assistant", "content": ""}),
        chunk({"tool_calls": [{"index": 0, "id": "chatcmpl-tool-7", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "chatcmpl-tool-8", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]}),
        chunk({}, "tool_calls"), USAGE, b"data: [DONE]\n\n",
    )
    kinds = [event["type"] for event in events]
    assert kinds.count("response.function_call_arguments.delta") == 3 and "response.output_text.delta" not in kinds
    done = [event for event in events if event["type"] == "response.function_call_arguments.done"]
    assert [json.loads(event["arguments"]) for event in done] == [{"city": "Paris"}, {"city": "Rome"}]
    final = accumulated(events, tools)
    assert [(item.type, item.call_id, item.name) for item in final.output] == [
        ("function_call", "chatcmpl-tool-7", "get_weather"), ("function_call", "chatcmpl-tool-8", "get_weather"),
    ]


def test_it_ends_a_stream_cut_at_max_output_tokens_with_response_incomplete():
    events = streamed({"max_output_tokens": 2}, chunk({"content": "Once upon"}, "length"), USAGE, b"data: [DONE]\n\n")
    assert events[-1]["type"] == "response.incomplete"
    final = Response.model_validate(events[-1]["response"])
    assert final.status == "incomplete" and final.incomplete_details is not None and final.output_text == "Once upon"
    assert final.output[0].status == "incomplete"


def test_it_gives_an_empty_answer_one_empty_message_as_a_whole_answer_has():
    events = streamed({}, chunk({"role": "assistant", "content": ""}), chunk({}, "stop"), USAGE, b"data: [DONE]\n\n")
    final = accumulated(events)
    assert final.output_text == "" and [item.type for item in final.output] == ["message"]


def test_it_turns_an_error_in_the_chat_stream_into_an_error_event_that_ends_it():
    error = api_errors.replica_failed("boom").body()
    events = streamed({}, chunk({"content": "Once"}), b"data: " + json.dumps(error).encode() + b"\n\n", chunk({"content": "more"}))
    assert [event["type"] for event in events][-2:] == ["response.output_text.delta", "error"]
    assert events[-1]["code"] == "replica_error" and "failed while answering" in events[-1]["message"]


def test_it_begins_even_when_the_chat_stream_ends_at_once():
    events = streamed({})
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
