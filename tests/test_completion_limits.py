# ruff: noqa: F811 (pytest fixtures are imported, then named as arguments)
"""Completions per minute, per API key and per organization, through both gateway entry points.

The pool is not running: a request the limiter lets through ends in a 503 from the unreachable
pool, one it refuses is a 429, so counting the two tells what the limiter did.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from accounts.services import create_api_key
from django.contrib.auth.models import User
from tests.inference_fixtures import BASE
from tests.limits import lower_limits, own_counters  # noqa: F401 (a fixture)
from tests.test_inference_gateway_auth import anyio_backend, keys, web  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.anyio]


async def _answers(web, key: str, n: int) -> list:
    return [
        await web.post("/v1/chat/completions", json={"model": BASE, "messages": [{"role": "user", "content": "hi"}]},
                       headers={"Authorization": f"Bearer {key}"})
        for _ in range(n)
    ]  # fmt: skip


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
