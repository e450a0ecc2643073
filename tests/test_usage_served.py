"""Usage accounting on the real engine: what the gateway (uvicorn, as ``bin/run`` starts it) counts
equals what the answers reported, for whole answers and for streams, whether or not the caller
asked for the stream's usage; and it reaches the usage API without anyone flushing it by hand."""

# ruff: noqa: F811 (pytest fixtures are imported from tests.inference_fixtures, then named as arguments)
from __future__ import annotations

import time

import pytest

from tests.inference_fixtures import BASE, alice, gateway  # noqa: F401 (fixtures)
from tests.processes import wait_until
from tests.served_answers import usage_reported

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

QUESTION = [{"role": "user", "content": "Name three colours."}]


def test_the_usage_api_reports_the_tokens_the_engine_answered_with(alice, gateway):
    started = int(time.time())
    ask = {"model": BASE, "messages": QUESTION, "max_tokens": 12, "temperature": 0}
    whole = alice.client.chat.completions.create(**ask)
    with_usage = list(alice.client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    without = list(alice.client.chat.completions.create(**ask, stream=True))
    assert with_usage[-1].usage == whole.usage  # the same request, greedy: the same tokens
    assert all(chunk.usage is None for chunk in without)  # not asked for, not sent, though the gateway asked

    wait_until(lambda: usage_reported(gateway, alice.api_key, started, 3), 30, "the gateway's usage flush")
    result = usage_reported(gateway, alice.api_key, started, 3)
    assert (result["model"], result["input_tokens"], result["output_tokens"]) == (
        BASE, 3 * whole.usage.prompt_tokens, 3 * whole.usage.completion_tokens
    )
