# ruff: noqa: F811 (pytest fixtures are imported, then named as arguments)
"""Completions and tokens per minute, per API key and per organization, through both gateway entry points.

The pool is not running: a request the limiter lets through ends in a 503 from the unreachable
pool, one it refuses is a 429, so counting the two tells what the limiter did.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from accounts.services import create_api_key
from django.contrib.auth.models import User
from tests.dead_pool import keys, web  # noqa: F401 (fixtures)
from tests.helpers import anyio_backend  # noqa: F401 (a fixture)
from tests.inference_fixtures import BASE
from tests.limits import lower_limits, own_counters  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.anyio]


async def _answers(web, key: str, times: int, **fields) -> list:
    body = {"model": BASE, "messages": [{"role": "user", "content": "hi"}], **fields}
    return [await web.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) for _ in range(times)]


def _statuses(responses) -> list[int]:
    return [response.status_code for response in responses]


async def test_it_answers_429_with_retry_after_past_a_keys_rate_and_other_organizations_go_on(web, keys, settings):
    lower_limits(settings, completions_per_minute_per_key=3)
    alice = await _answers(web, keys["alice"], 5)
    assert [response.status_code for response in alice] == [503, 503, 503, 429, 429]
    refused = alice[-1]
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    error = refused.json()["error"]
    assert error["type"] == "requests" and error["code"] == "rate_limit_exceeded"
    assert "COMPLETIONS_PER_MINUTE_PER_KEY" in error["message"] and "3 completions per minute" in error["message"]

    charlie = await _answers(web, keys["charlie"], 3)
    assert [response.status_code for response in charlie] == [503, 503, 503]


@pytest.fixture
def alices_second_key(keys) -> str:
    return create_api_key(keys["alice_org"], User.objects.get(username="alice"), "second")[1]


async def test_it_holds_all_of_an_organizations_keys_to_the_organizations_rate(web, keys, alices_second_key, settings):
    lower_limits(settings, completions_per_minute_per_key=3, completions_per_minute_per_organization=4)
    assert [response.status_code for response in await _answers(web, keys["alice"], 3)] == [503, 503, 503]
    second = await _answers(web, alices_second_key, 2)
    assert [response.status_code for response in second] == [503, 429]
    assert "COMPLETIONS_PER_MINUTE_PER_ORGANIZATION" in second[1].json()["error"]["message"]


async def test_it_lets_requests_through_and_warns_while_redis_is_down(web, keys, settings, caplog, monkeypatch):
    lower_limits(settings, completions_per_minute_per_key=1)
    settings.CONFIG = dataclasses.replace(settings.CONFIG, redis_url="redis://127.0.0.1:9/0")  # nothing listens
    monkeypatch.setattr("core.rate_limits._last_warning", -math.inf)  # an earlier test may have warned already
    assert [response.status_code for response in await _answers(web, keys["alice"], 3)] == [503, 503, 503]
    assert "rate limits are not enforced" in caplog.text


# "user" and "hi": 6 characters, 2 tokens by the estimate, beside what the request may generate.
async def test_it_charges_each_request_its_prompt_and_max_tokens_against_the_tokens_per_minute(web, keys, settings):
    lower_limits(settings, tokens_per_minute_per_key=1000)
    assert _statuses(await _answers(web, keys["alice"], 4, max_tokens=300)) == [503, 503, 503, 429]  # 3 x 302 tokens
    refused = (await _answers(web, keys["alice"], 1, max_tokens=300))[0]
    error = refused.json()["error"]
    assert error["type"] == "tokens" and error["code"] == "rate_limit_exceeded" and 1 <= int(refused.headers["Retry-After"]) <= 60
    assert "TOKENS_PER_MINUTE_PER_KEY" in error["message"] and "1,000 tokens per minute" in error["message"]
    assert _statuses(await _answers(web, keys["alice"], 1, max_tokens=50)) == [503]  # 52 more still fit: tokens, not requests
    assert _statuses(await _answers(web, keys["charlie"], 1, max_tokens=300)) == [503]


async def test_a_request_without_max_tokens_costs_the_models_whole_context_and_n_multiplies_it(web, keys, settings):
    lower_limits(settings, tokens_per_minute_per_key=5000)  # the base model's context is 2,048 tokens
    assert _statuses(await _answers(web, keys["alice"], 3)) == [503, 503, 429]
    assert _statuses(await _answers(web, keys["charlie"], 2, max_tokens=1500, n=2)) == [503, 429]  # 3,002 each


async def test_a_request_alone_over_the_tokens_per_minute_is_a_400_that_says_to_lower_max_tokens_and_costs_nothing(
    web, keys, settings
):
    lower_limits(settings, tokens_per_minute_per_key=1000)
    refused = (await _answers(web, keys["alice"], 1))[0]  # up to the whole context: 2,050 tokens
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "request_too_large" and "max_tokens" in error["message"] and "2,050 tokens" in error["message"]
    assert _statuses(await _answers(web, keys["alice"], 3, max_tokens=300)) == [503, 503, 503]
