# ruff: noqa: F811 (pytest fixtures are imported from tests.recording_pool, then named as arguments)
"""Usage accounting: the gateway counts each completion's tokens as the answer passes (whole or
streamed, API or playground), writes them per organization, model, key and minute, and reports
them in the shape of OpenAI's usage API and on the dashboard's usage page.

The pool is a stand-in that answers with known usage (the real engine's answers are counted in
``tests/test_usage_served.py``); everything else is the real gateway, both of its entry points.
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta, timezone

import pytest
from django.urls import reverse
from django.utils import timezone as django_time

from finetuning.models import FineTuningJob, JobStatus
from tests.helpers import anyio_backend  # noqa: F401 (a fixture)
from tests.inference_fixtures import BASE
from tests.recording_pool import stand_in_pool, web  # noqa: F401 (fixtures: both gateway entry points)
from usage.answers import StreamTokens, Tokens
from usage.meter import METER, Caller
from usage.models import CompletionUsage

pytestmark = [pytest.mark.django_db(transaction=True)]

DAY = 86400
USAGE = {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16, "prompt_tokens_details": {"cached_tokens": 4}}


def _sse(*events: dict | str) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, str) else json.dumps(e)).encode() + b"\n\n" for e in events)


STREAM = _sse(
    {"choices": [{"index": 0, "delta": {"content": "Par"}}]},
    {"choices": [{"index": 0, "delta": {"content": "is"}, "finish_reason": "stop"}]},
    {"choices": [], "usage": USAGE},
    "[DONE]",
)


# --- reading an answer's tokens ------------------------------------------------------------------


def test_a_streams_usage_event_is_read_and_taken_out_when_the_caller_did_not_ask_for_it():
    reader = StreamTokens(caller_asked_for_usage=False, prompt_estimate=99)
    # Split anywhere, even inside an event: events are relayed whole.
    relayed = b"".join(reader.feed(STREAM[i : i + 7]) for i in range(0, len(STREAM), 7)) + reader.end()
    assert relayed == _sse(*[json.loads(STREAM.split(b"\n\n")[i][6:]) for i in range(2)], "[DONE]")
    assert reader.tokens == Tokens(prompt=11, completion=5, cached=4)


def test_a_streams_usage_event_stays_when_the_caller_asked_for_it():
    reader = StreamTokens(caller_asked_for_usage=True, prompt_estimate=99)
    assert reader.feed(STREAM) + reader.end() == STREAM
    assert reader.tokens == Tokens(11, 5, 4)


def test_a_stream_left_before_its_end_counts_the_chunks_relayed_and_the_estimated_prompt():
    reader = StreamTokens(caller_asked_for_usage=False, prompt_estimate=9)
    reader.feed(STREAM.split(b"data: {\"choices\": []")[0])
    assert reader.tokens == Tokens(prompt=9, completion=2)


def test_a_stream_asks_the_pool_for_its_usage_and_keeps_the_callers_stream_options():
    from answering.forwarded_body import forwarded_body

    def forwarded(sent: dict) -> dict:
        return json.loads(forwarded_body(json.dumps(sent).encode(), sent, "salt", bool(sent.get("stream"))))

    assert forwarded({"model": BASE, "stream": True})["stream_options"] == {"include_usage": True}
    both = forwarded({"model": BASE, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert both["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    assert "stream_options" not in forwarded({"model": BASE})
    assert forwarded({"model": BASE, "stream": True, "stream_options": "x"})["stream_options"] == "x"  # vLLM's 400


# --- counting at the gateway ----------------------------------------------------------------------


class UsagePool:
    """Answers a completion with ``USAGE``: whole, or as ``STREAM`` when the request streams; a
    request for the model ``refused`` gets a 400. Keeps the bodies it was sent."""

    def __init__(self):
        self.bodies: list[dict] = []

    async def answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
                length = int(head.split("content-length:")[1].split("\r\n")[0])
                body = json.loads(await reader.readexactly(length))
                self.bodies.append(body)
                if body.get("stream"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                    writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(STREAM), STREAM))
                else:
                    answer = json.dumps({"object": "chat.completion", "choices": [], "usage": USAGE}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(answer), answer))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


@pytest.fixture
async def pool(settings):
    """This module's stand-in pool, for the ``web`` fixture of ``tests.recording_pool``."""
    async with stand_in_pool(settings, UsagePool()) as answering:
        yield answering


@pytest.fixture(autouse=True)
def nothing_pending():
    METER.flush()  # counts another test left unwritten (its rows are gone) are not this test's
    CompletionUsage.objects.all().delete()


def _bearer(persona) -> dict:
    return {"Authorization": f"Bearer {persona.key}"}


def _chat(**fields) -> dict:
    return {"model": BASE, "messages": [{"role": "user", "content": "hi"}], **fields}


def _counted(organization) -> dict:
    METER.flush()
    rows = CompletionUsage.objects.filter(organization=organization)
    return {
        (row.model, row.api_key.prefix if row.api_key else None): (row.requests, row.prompt_tokens, row.completion_tokens, row.cached_tokens)
        for row in rows
    }


@pytest.mark.anyio
async def test_the_gateway_counts_whole_and_streamed_answers_per_key_and_model(web, pool, alice, bob, charlie):
    from accounts.models import ApiKey

    for persona in (alice, alice, bob):
        assert (await web.post("/v1/chat/completions", json=_chat(), headers=_bearer(persona))).status_code == 200
    streamed = await web.post("/v1/chat/completions", json=_chat(stream=True), headers=_bearer(alice))
    assert streamed.status_code == 200 and b'"usage"' not in streamed.content  # she did not ask for it
    assert pool.bodies[-1]["stream_options"] == {"include_usage": True}  # the gateway did
    asked = await web.post(
        "/v1/chat/completions", json=_chat(stream=True, stream_options={"include_usage": True}), headers=_bearer(bob)
    )
    assert b'"usage"' in asked.content

    counted = await asyncio.to_thread(_counted, alice.organization)
    alices, bobs = [await asyncio.to_thread(lambda: ApiKey.objects.get(created_by=p.user).prefix) for p in (alice, bob)]
    assert counted == {(BASE, alices): (3, 33, 15, 12), (BASE, bobs): (2, 22, 10, 8)}
    assert await asyncio.to_thread(_counted, charlie.organization) == {}


@pytest.mark.anyio
async def test_a_refused_completion_is_not_usage(web, pool, alice):
    unknown = await web.post("/v1/chat/completions", json=_chat(model="nope"), headers=_bearer(alice))
    too_many = await web.post("/v1/chat/completions", json=_chat(max_tokens="x"), headers=_bearer(alice))
    assert unknown.status_code == 404 and too_many.status_code == 400 and pool.bodies == []
    assert await asyncio.to_thread(_counted, alice.organization) == {}


@pytest.mark.anyio
async def test_the_playground_counts_for_the_organization_without_a_key(pool, alice):
    from dashboard.playground import completion_body
    from gateway.completions import complete_for_organization

    answer = await complete_for_organization(alice.organization, completion_body(json.dumps(_chat()).encode()), "chat/completions")
    assert b"".join([chunk async for chunk in answer.stream])
    assert await asyncio.to_thread(_counted, alice.organization) == {(BASE, None): (1, 11, 5, 4)}


def test_flushes_add_to_the_minutes_row_and_drop_a_deleted_organizations_counts(alice, charlie):
    at = datetime(2026, 11, 30, 12, 0, 30, tzinfo=timezone.utc)
    for _ in range(2):
        METER.record(Caller(alice.organization.pk, None, BASE), Tokens(3, 2), at=at)
        METER.flush()
    METER.record(Caller(charlie.organization.pk, None, BASE), Tokens(1, 1), at=at)
    charlie.organization.delete()
    METER.flush()  # charlie's counts have nobody to bill: dropped, and the flush goes on
    row = CompletionUsage.objects.get()
    assert (row.organization_id, row.minute, row.requests, row.prompt_tokens) == (alice.organization.pk, at.replace(second=0), 2, 6)


def test_a_flush_the_database_refuses_keeps_its_counts_for_the_next(alice, monkeypatch):
    from django.db import OperationalError

    METER.record(Caller(alice.organization.pk, None, BASE), Tokens(3, 2))

    def outage(*args):
        raise OperationalError("the database is away")

    with monkeypatch.context() as patched:
        patched.setattr("usage.meter._add", outage)
        with pytest.raises(OperationalError):
            METER.flush()
    assert CompletionUsage.objects.count() == 0
    METER.flush()
    assert CompletionUsage.objects.get().requests == 1


# --- the usage API --------------------------------------------------------------------------------

START = int(datetime(2026, 11, 1, tzinfo=timezone.utc).timestamp())


def _usage(persona, minute_offset_s: int, model: str = BASE, requests=1, prompt=10, completion=5, key=True):
    from accounts.models import ApiKey

    api_key = ApiKey.objects.filter(organization=persona.organization).first() if key else None
    CompletionUsage.objects.create(
        organization=persona.organization, api_key=api_key, model=model, requests=requests,
        minute=datetime.fromtimestamp(START + minute_offset_s, timezone.utc), prompt_tokens=prompt,
        completion_tokens=completion,
    )


def _get(persona, kind: str = "completions", **params):
    return persona.api.get(f"/v1/organization/usage/{kind}", params)


def test_usage_comes_in_daily_buckets_summed_over_models(alice, charlie):
    _usage(alice, 60)
    _usage(alice, 3600, model=f"{BASE}:tuned", requests=2, prompt=20, completion=8)
    _usage(alice, DAY + 120, key=False)  # the playground's
    _usage(charlie, 60, requests=50)
    page = _get(alice, start_time=START, end_time=START + 3 * DAY).json()
    assert page["object"] == "page" and page["has_more"] is False and page["next_page"] is None
    assert [(b["start_time"], b["end_time"]) for b in page["data"]] == [(START + i * DAY, START + (i + 1) * DAY) for i in range(3)]
    first, second, third = (bucket["results"] for bucket in page["data"])
    assert first == [{
        "object": "organization.usage.completions.result", "input_tokens": 30, "output_tokens": 13,
        "input_cached_tokens": 0, "num_model_requests": 3, "model": None, "api_key_id": None, "batch": None,
    }]
    assert second[0]["num_model_requests"] == 1 and third == []


def test_usage_groups_by_model_and_key_and_filters_by_model(alice):
    from accounts.models import ApiKey

    tuned = f"{BASE}:tuned"
    _usage(alice, 60)
    _usage(alice, 120, model=tuned, requests=2)
    _usage(alice, 180, model=tuned, requests=4, key=False)
    key = ApiKey.objects.get(organization=alice.organization).prefix
    results = _get(alice, start_time=START, end_time=START + DAY, group_by="model,api_key_id").json()["data"][0]["results"]
    got = sorted((r["model"], r["api_key_id"] or "", r["num_model_requests"]) for r in results)
    assert got == sorted([(BASE, key, 1), (tuned, key, 2), (tuned, "", 4)])  # "": the playground's
    only = _get(alice, start_time=START, end_time=START + DAY, group_by=["model"], models=tuned).json()
    assert [(r["model"], r["num_model_requests"]) for r in only["data"][0]["results"]] == [(tuned, 6)]


def test_usage_pages_through_buckets_with_next_page(alice):
    for hour in range(5):
        _usage(alice, hour * 3600 + 60, requests=hour + 1)
    query = {"start_time": START, "end_time": START + 5 * 3600, "bucket_width": "1h", "limit": 2}
    seen, page = [], _get(alice, **query).json()
    while True:
        seen += [bucket["results"][0]["num_model_requests"] for bucket in page["data"]]
        if not page["has_more"]:
            break
        page = _get(alice, **query, page=page["next_page"]).json()
    assert seen == [1, 2, 3, 4, 5]


def test_a_minute_wide_bucket_starts_on_the_minute(alice):
    _usage(alice, 125)
    page = _get(alice, start_time=START + 130, end_time=START + 240, bucket_width="1m").json()
    assert [b["start_time"] for b in page["data"]] == [START + 120, START + 180]
    assert page["data"][0]["results"][0]["num_model_requests"] == 1


def test_trained_tokens_are_the_succeeded_jobs_on_the_day_they_finished(alice, charlie):
    finished = datetime.fromtimestamp(START + DAY + 5, timezone.utc)

    def job(persona, status, tokens, suffix):
        return FineTuningJob.objects.create(
            organization=persona.organization, model=BASE, training_file="file-x", suffix=suffix, seed=1,
            hyperparameters={}, status=status, trained_tokens=tokens, fine_tuned_model=f"{BASE}:{suffix}",
            finished_at=finished,
        )

    job(alice, JobStatus.SUCCEEDED, 1000, "a")
    job(alice, JobStatus.SUCCEEDED, 500, "a2")
    job(alice, JobStatus.FAILED, None, "b")
    job(charlie, JobStatus.SUCCEEDED, 7, "c")
    page = _get(alice, "fine_tuning", start_time=START, end_time=START + 2 * DAY, group_by="model").json()
    assert page["data"][0]["results"] == []
    assert [(r["model"], r["trained_tokens"], r["num_jobs"]) for r in page["data"][1]["results"]] == [
        (f"{BASE}:a", 1000, 1), (f"{BASE}:a2", 500, 1)
    ]
    assert _get(alice, "fine_tuning", start_time=START, group_by="api_key_id").json()["error"]["param"] == "group_by"


@pytest.mark.parametrize("params, param, says", [
    ({}, "start_time", "start_time is required"),
    ({"start_time": "yesterday"}, "start_time", "whole number"),
    ({"start_time": START, "end_time": START}, "end_time", "must be after start_time"),
    ({"start_time": START, "bucket_width": "1w"}, "bucket_width", "1m, 1h, 1d"),
    ({"start_time": START, "limit": 32}, "limit", "from 1 to 31"),
    ({"start_time": START, "bucket_width": "1h", "limit": 0}, "limit", "from 1 to 168"),
    ({"start_time": START, "group_by": "project_id"}, "group_by", "model or api_key_id"),
    ({"start_time": START, "page": START + 7}, "page", "next_page"),
])
def test_a_malformed_usage_query_is_a_400_that_names_what_to_fix(alice, params, param, says):
    response = _get(alice, **params)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param and says in response.json()["error"]["message"]


def test_usage_needs_an_api_key():
    from rest_framework.test import APIClient

    assert APIClient().get("/v1/organization/usage/completions", {"start_time": START}).status_code == 401


# --- the dashboard's usage page ------------------------------------------------------------------


def test_the_usage_page_charts_tokens_a_day_by_model_and_totals_them(alice, client):
    today = int(django_time.now().timestamp())
    for days_ago, model, completion in ((0, BASE, 5), (1, f"{BASE}:tuned", 90), (20, BASE, 300), (40, BASE, 1000)):
        CompletionUsage.objects.create(
            organization=alice.organization, model=model, requests=1, prompt_tokens=10, completion_tokens=completion,
            minute=datetime.fromtimestamp(today, timezone.utc).replace(second=0) - timedelta(days=days_ago),
        )
    client.force_login(alice.user)
    page = client.get(reverse("dashboard:usage")).content.decode()
    assert 'data-total="115"' in page  # the last 14 days: today's and yesterday's
    assert page.count('<rect class="series-') == 2
    assert f'<code>{BASE}:tuned</code></td><td class="number">1</td><td class="number">10</td>' in page
    assert 'data-total="425"' in client.get(reverse("dashboard:usage"), {"days": "30"}).content.decode()
