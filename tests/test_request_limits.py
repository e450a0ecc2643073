# ruff: noqa: F811 (pytest fixtures are imported from tests.recording_pool, then named as arguments)
"""Limits before work: a request's size, a completion's fields and caps, checked before the web
process does anything for it, and each tenant's own prefix cache in vLLM (``cache_salt``).

The web application is built as ``server/asgi.py`` builds it (the body limits outermost), through
both of the gateway's entry points. The pool is a stand-in that records the bodies it receives.
"""

from __future__ import annotations

import dataclasses
import html
import io
import json

import pytest

from tests.helpers import anyio_backend  # noqa: F401 (a fixture)
from tests.inference_fixtures import BASE
from tests.personas import good_dataset
from tests.recording_pool import _bearer, _chat, _error, _limits, _user, pool, web  # noqa: F401 (pool, web: fixtures)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.anyio]


async def _chunks(pieces: int, size: int, pulled: list[int]):
    for _ in range(pieces):
        pulled.append(size)
        yield b"x" * size


# --- the size of a body ------------------------------------------------------------------------


async def test_it_answers_413_for_an_oversized_completion_before_looking_at_the_key(web, pool, settings):
    _limits(settings, completion_body_bytes=1000)
    body = json.dumps(_chat(messages=_user("x" * 2000))).encode()
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        response = await web.post("/v1/chat/completions", content=body, headers=headers)
        assert response.status_code == 413  # not 401: the key is not even looked at
        error = _error(response)
        assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
        assert "1,000 bytes" in error["message"] and "MAX_COMPLETION_BODY_BYTES" in error["message"]
    assert pool.bodies == []


async def test_it_stops_a_chunked_body_once_it_passes_the_cap(web, pool, settings):
    _limits(settings, completion_body_bytes=1000)
    pulled: list[int] = []
    response = await web.post("/v1/completions", content=_chunks(100, 300, pulled))
    assert response.status_code == 413 and "MAX_COMPLETION_BODY_BYTES" in _error(response)["message"]
    assert sum(pulled) < 100 * 300  # refused while the body was still arriving, not after all of it
    assert pool.bodies == []


async def test_it_caps_other_requests_with_the_default_limit(web, settings):
    _limits(settings, request_body_bytes=1000)
    response = await web.post("/v1/fine_tuning/jobs", content=b"{" + b" " * 2000 + b"}")
    assert response.status_code == 413 and "MAX_REQUEST_BODY_BYTES" in _error(response)["message"]


def _multipart(data: bytes) -> dict:
    return {"files": {"file": ("train.jsonl", io.BytesIO(data))}, "data": {"purpose": "fine-tune"}}


async def test_it_refuses_an_oversized_upload_and_stores_nothing(web, alice, settings, monkeypatch):
    from asgiref.sync import sync_to_async
    from finetuning import storage
    from finetuning.models import File

    stored: list[str] = []
    monkeypatch.setattr(storage.files(), "put", lambda key, data: stored.append(key))
    settings.CONFIG = dataclasses.replace(settings.CONFIG, max_upload_bytes=1024)
    dataset = good_dataset(2000)  # about 150 kB: over the cap and its allowance for the form around the file
    for path in ("/v1/files", "/datasets"):  # the API, and the dashboard's upload form
        response = await web.post(path, headers=_bearer(alice), **_multipart(dataset))
        assert response.status_code == 413 and "MAX_UPLOAD_MB" in _error(response)["message"]
    pulled: list[int] = []
    chunked = await web.post("/v1/files", headers=_bearer(alice), content=_chunks(100, 4096, pulled))
    assert chunked.status_code == 413 and sum(pulled) < 100 * 4096
    assert stored == [] and not await sync_to_async(File.objects.exists)()


BROWSER = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}  # Chromium's, for a form


async def test_it_answers_a_browsers_dashboard_form_with_a_page_and_the_api_with_json(web, alice, settings):
    from base.upload_limits import file_too_large_message

    settings.CONFIG = dataclasses.replace(settings.CONFIG, max_upload_bytes=1024)
    pulled: list[int] = []
    for body in (_multipart(good_dataset(2000)), {"content": _chunks(100, 4096, pulled)}):  # declared, then chunked
        page = await web.post("/datasets", headers=BROWSER, **body)
        assert page.status_code == 413 and page.headers["content-type"].startswith("text/html")
        assert html.escape(file_too_large_message()) in page.text and "1024 bytes" in file_too_large_message()
        assert '<a href="/datasets">' in page.text
    other = await web.post("/keys", headers=BROWSER, content=b"x" * 2_000_000)  # any other form: the generic sentence
    assert other.status_code == 413 and "MAX_REQUEST_BODY_BYTES" in other.text and '<a href="/">' in other.text
    # The API is answered in its own shape whatever the client accepts; so are the dashboard's scripts.
    api = await web.post("/v1/files", headers=_bearer(alice) | BROWSER, **_multipart(good_dataset(2000)))
    script = await web.post("/playground/chat", headers={"Accept": "*/*"}, content=b"x" * 2_000_000)
    for response in (api, script):
        assert response.status_code == 413 and _error(response)["code"] == "request_too_large"


async def test_an_adapter_upload_has_its_own_cap(web, alice, settings):
    """Above the default body cap (1 MiB) but under MAX_ADAPTER_UPLOAD_MB: the archive itself is looked at."""
    settings.CONFIG = dataclasses.replace(settings.CONFIG, max_adapter_upload_bytes=4 * 1024 * 1024)
    form = {"data": {"model": BASE, "suffix": "capped"}}
    looked_at = await web.post(
        "/v1/fine_tuning/adapters", headers=_bearer(alice), files={"file": ("a.tar.gz", b"x" * 2_000_000)}, **form
    )
    assert looked_at.status_code == 400 and _error(looked_at)["code"] == "invalid_adapter"
    over = await web.post(
        "/v1/fine_tuning/adapters", headers=_bearer(alice), files={"file": ("a.tar.gz", b"x" * 5_000_000)}, **form
    )
    assert over.status_code == 413 and "MAX_ADAPTER_UPLOAD_MB" in _error(over)["message"]


async def test_the_dashboards_adapter_form_has_the_adapter_cap_and_a_browser_gets_the_forms_sentence(web, settings):
    from base.upload_limits import adapter_too_large_message

    settings.CONFIG = dataclasses.replace(settings.CONFIG, max_adapter_upload_bytes=4 * 1024 * 1024)
    # Over the default body cap (1 MiB), under the adapter's: Django reads it (and, without a session or
    # a CSRF token, refuses it), the size layer does not.
    under = await web.post("/models/upload", headers=BROWSER, files={"adapter-file": ("a.tar.gz", b"x" * 2_000_000)})
    assert under.status_code == 403 and "CSRF" in under.text
    over = await web.post("/models/upload", headers=BROWSER, files={"adapter-file": ("a.tar.gz", b"x" * 5_000_000)})
    assert over.status_code == 413 and html.escape(adapter_too_large_message()) in over.text
    assert "4.0 MB" in adapter_too_large_message() and '<a href="/models/upload">' in over.text


async def test_it_still_accepts_an_upload_under_the_cap(web, alice):
    response = await web.post("/v1/files", headers=_bearer(alice), **_multipart(good_dataset(12)))
    assert response.status_code == 200, response.text


# --- the fields of a completion ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "body", "field"),
    [
        ("chat/completions", _chat(guided_json={"type": "object"}), "guided_json"),  # removed from vLLM: ignored there
        ("chat/completions", _chat(kv_transfer_params={}), "kv_transfer_params"),  # vLLM's, for its operator only
        ("completions", {"model": BASE, "prompt": "hi", "messages": []}, "messages"),  # a chat field
    ],
)
async def test_it_answers_400_naming_an_unknown_field(web, pool, alice, endpoint, body, field):
    response = await web.post(f"/v1/{endpoint}", json=body, headers=_bearer(alice))
    error = _error(response)
    assert response.status_code == 400 and error["param"] == field and error["code"] == "unknown_parameter"
    assert f"'{field}'" in error["message"]
    assert pool.bodies == []


@pytest.mark.parametrize(
    ("endpoint", "body", "param", "setting"),
    [
        ("chat/completions", _chat(n=9), "n", "MAX_COMPLETION_N"),
        ("chat/completions", _chat(n=1e9), "n", "MAX_COMPLETION_N"),  # a float vLLM would take as an int
        ("chat/completions", _chat(max_tokens=4097), "max_tokens", "MAX_COMPLETION_TOKENS"),
        ("chat/completions", _chat(max_completion_tokens=4097), "max_completion_tokens", "MAX_COMPLETION_TOKENS"),
        ("completions", {"model": BASE, "prompt": "hi", "min_tokens": 4097}, "min_tokens", "MAX_COMPLETION_TOKENS"),
        ("chat/completions", _chat(logprobs=True, top_logprobs=21), "top_logprobs", "MAX_LOGPROBS"),
        ("completions", {"model": BASE, "prompt": "hi", "logprobs": 21}, "logprobs", "MAX_LOGPROBS"),
        ("completions", {"model": BASE, "prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", "MAX_LOGPROBS"),
        ("chat/completions", _chat(messages=_user("hi") * 257), "messages", "MAX_MESSAGES"),
        ("chat/completions", _chat(messages=_user("x" * 270_000)), "messages", "MAX_PROMPT_CHARS"),
        (
            "chat/completions",
            _chat(messages=_user([{"type": "text", "text": "x" * 140_000}] * 2)),
            "messages", "MAX_PROMPT_CHARS",
        ),
        ("completions", {"model": BASE, "prompt": ["x" * 200_000, "y" * 100_000]}, "prompt", "MAX_PROMPT_CHARS"),
    ],
)
async def test_it_answers_400_naming_the_limit_a_completion_passes(web, pool, alice, endpoint, body, param, setting):
    response = await web.post(f"/v1/{endpoint}", json=body, headers=_bearer(alice))
    error = _error(response)
    assert response.status_code == 400 and error["param"] == param and error["code"] == "limit_exceeded"
    assert setting in error["message"]
    assert pool.bodies == []


async def test_it_answers_400_for_a_capped_field_that_is_not_a_number(web, alice):
    response = await web.post("/v1/chat/completions", json=_chat(n="9"), headers=_bearer(alice))
    assert response.status_code == 400 and _error(response)["param"] == "n"


async def test_it_checks_the_key_before_the_fields(web):
    response = await web.post("/v1/chat/completions", json=_chat(n=1000), headers={"Authorization": "Bearer sk-wrong"})
    assert response.status_code == 401


async def test_it_forwards_a_request_within_the_limits_with_the_fields_it_was_sent(web, pool, alice):
    sent = _chat(
        max_tokens=16, temperature=0, n=2, stream_options={"include_usage": True}, ignore_eos=True, min_tokens=4,
        response_format={"type": "json_object"}, logprobs=True, top_logprobs=5, seed=7, stop=["\n"],
    )
    response = await web.post("/v1/chat/completions", json=sent, headers=_bearer(alice))
    assert response.status_code == 200 and response.json() == {}
    forwarded = json.loads(pool.bodies[0])
    assert {name: value for name, value in forwarded.items() if name != "cache_salt"} == sent


# --- each tenant's own prefix cache --------------------------------------------------------------


async def test_it_forwards_the_organizations_cache_salt_and_not_the_callers(web, pool, alice, bob, charlie):
    from answering.cache_salt import cache_salt

    for persona in (alice, bob, charlie):
        await web.post("/v1/chat/completions", json=_chat(), headers=_bearer(persona))
        guessing = {"model": BASE, "prompt": "hi", "cache_salt": "guessed"}
        await web.post("/v1/completions", json=guessing, headers=_bearer(persona))
    salts = [json.loads(body)["cache_salt"] for body in pool.bodies]
    alices, charlies = cache_salt(alice.organization.pk), cache_salt(charlie.organization.pk)
    assert salts == [alices] * 4 + [charlies] * 2  # bob shares alice's organization, so her cache
    assert alices != charlies and "guessed" not in salts
    assert pool.bodies[1].count(b'"cache_salt"') == 1  # the caller's is replaced, not followed by ours


async def test_it_salts_the_playgrounds_requests_with_the_organization(pool, alice):
    from dashboard.playground import completion_body
    from answering.cache_salt import cache_salt
    from gateway.completions import complete_for_organization

    body = completion_body(json.dumps(_chat()).encode())
    await complete_for_organization(alice.organization, body, "chat/completions")
    assert json.loads(pool.bodies[0])["cache_salt"] == cache_salt(alice.organization.pk)
