"""The one JSON parser for tenants' bodies (``core.strict_json``): plain JSON in, each kind of
non-standard or extreme value refused naming where it is."""

from __future__ import annotations

import json

import pytest

from core import api_errors, strict_json


@pytest.mark.parametrize(
    ("raw", "param", "said"),
    [
        ('{"max_tokens": NaN}', "max_tokens", "'max_tokens' is NaN"),
        ('{"n": -Infinity}', "n", "'n' is an infinity"),
        ('{"logit_bias": {"42": Infinity}}', "logit_bias.42", "'logit_bias.42' is an infinity"),
        ('{"temperature": 1e400}', "temperature", "a number past ±1.8e308"),
        ('{"stop_token_ids": [1, -1e999]}', "stop_token_ids.1", "an infinity"),
        ('{"seed": 9223372036854775808}', "seed", "integers must lie from -9,223,372,036,854,775,808"),
        ('{"seed": -9223372036854775809}', "seed", "'seed' is an integer of 64 bits"),
        ('{"seed": ' + "9" * 5000 + "}", "seed", "'seed' is a number too long to read"),
        ('{"messages": [{"content": "a\\u0000b"}]}', "messages.0.content", "NUL character"),
        ('{"a\\u0000": 1}', "body", "a key in 'body' holds a NUL character"),
        ('{"response_format": ' + "[" * 70 + "]" * 70 + "}", "response_format", "deeper than 64 levels in 'response_format'"),
        ("[" * 100_000, None, "deeper than 64 levels"),
        ('{"model": "\\ud800"}', None, "lone UTF-16 surrogate"),
        ("", None, "the body is empty"),
        ('{"model": "x",}', None, "not valid JSON"),
        ("NaN", "body", "'body' is NaN"),
    ],
)
def test_it_refuses_what_json_does_not_hold_or_no_field_takes_naming_where(raw, param, said):
    with pytest.raises(strict_json.JsonRefused) as refused:
        strict_json.loads(raw.encode())
    assert refused.value.param == param and said in refused.value.detail


def test_it_reads_plain_json_as_vllm_does_to_its_edges():
    deepest = "[" * 63 + "]" * 63  # with the object around it: 64 levels
    raw = (
        '{"model": "m", "model": "last", "temperature": 1e308, "seed": -9223372036854775808, "top": 9223372036854775807,'
        f' "emoji": "\\ud83d\\ude00", "nested": {deepest}, "ok": [true, null, 0.5]}}'
    )
    value = strict_json.loads(raw)
    assert value["model"] == "last"  # the last of duplicated keys, as json.loads
    assert value["temperature"] == 1e308 and value["seed"] == -(2**63) and value["top"] == 2**63 - 1
    assert value["emoji"] == "😀" and value == json.loads(raw)


def test_a_refused_body_is_a_400_in_the_apis_shape_naming_the_field():
    with pytest.raises(api_errors.ApiError) as refused:
        strict_json.body(b'{"model": "m", "max_tokens": NaN}')
    error = refused.value
    assert error.status == 400 and error.code == "invalid_body" and error.param == "max_tokens"
    assert "'max_tokens' is NaN, which is not a JSON number" in error.message
