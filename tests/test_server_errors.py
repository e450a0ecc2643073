"""Errors as clients see them: under /v1/ always OpenAI-shaped JSON, in development and production
mode alike, with nothing of a traceback or the settings; elsewhere a page for people."""

from __future__ import annotations

import asyncio
import logging
import secrets
import sys

import httpx
import pytest
from django.test import Client
from django.test.client import RequestFactory
from django.views.debug import technical_500_response

import gateway.completions
from gateway.asgi import with_fast_path

pytestmark = pytest.mark.django_db

BUG = "a bug's message that names SECRET_KEY"


def _boom(*args, **kwargs):
    raise RuntimeError(BUG)


def assert_api_500(response, settings) -> None:
    assert response.status_code == 500 and response["Content-Type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("server_error", "internal_error")
    body = response.content.decode()
    for leak in (BUG, "Traceback", "RuntimeError", settings.SECRET_KEY, settings.INTERNAL_TOKEN, "INSTALLED_APPS"):
        assert leak not in body


@pytest.mark.parametrize("debug", [True, False], ids=["development", "production"])
@pytest.mark.parametrize(
    ("path", "broken"),
    [("/v1/files", "finetuning.views.list_page"), ("/v1/models", "gateway.views.usable_models")],
    ids=["drf-view", "async-gateway-view"],
)
def test_it_answers_a_bug_under_v1_with_a_json_500(alice, settings, monkeypatch, caplog, debug, path, broken):
    settings.DEBUG = debug
    monkeypatch.setattr(broken, _boom)
    with caplog.at_level(logging.ERROR, logger="django.request"):
        response = alice.api.get(path)
    assert_api_500(response, settings)
    logged = [record for record in caplog.records if record.exc_info and record.exc_info[1].args == (BUG,)]
    assert len(logged) == 1  # the traceback is in the log, once


@pytest.mark.parametrize("debug", [True, False], ids=["development", "production"])
def test_it_answers_unknown_v1_paths_with_json_in_every_mode(settings, debug):
    settings.DEBUG = debug
    for response in (Client().get("/v1/nothing/here"), Client(enforce_csrf_checks=True).post("/v1/nothing")):
        assert response.status_code == 404 and response.json()["error"]["code"] == "unknown_url"


def test_it_answers_a_bug_in_the_fast_completion_path_with_a_json_500(monkeypatch, settings):
    monkeypatch.setattr(gateway.completions, "complete", _boom)  # imported when the fast path is built

    async def django_application(scope, receive, send):
        raise AssertionError("completions must not reach Django")

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=with_fast_path(django_application))
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            return await client.post("/v1/chat/completions", json={"model": "m", "messages": []})

    response = asyncio.run(post())
    assert response.status_code == 500 and response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "internal_error") and BUG not in response.text


def test_it_shows_people_a_page_for_a_bug_outside_the_api(alice, settings, monkeypatch):
    settings.DEBUG = False
    monkeypatch.setattr("dashboard.views._page", _boom)
    browser = Client(raise_request_exception=False)
    browser.force_login(alice.user)
    response = browser.get("/datasets")
    assert response.status_code == 500 and response["Content-Type"].startswith("text/html")
    assert "Server error" in response.content.decode() and BUG not in response.content.decode()


def _debug_page() -> str:
    """Django's debug page for a bug in a view; its traceback shows this frame and _boom's, whose
    source and variables hold no secret."""
    try:
        _boom()
    except RuntimeError:
        return technical_500_response(RequestFactory().get("/datasets"), *sys.exc_info()).content.decode()


def test_it_hides_our_secret_settings_on_the_debug_page(settings):
    secret = secrets.token_hex(16)
    settings.DEBUG = True
    settings.INTERNAL_TOKEN = settings.MONITORING_TOKEN = secret
    settings.CELERY_BROKER_URL = settings.CELERY_RESULT_BACKEND = f"redis://:{secret}@redis.internal:6379/0"
    page = _debug_page()
    for name in ("INTERNAL_TOKEN", "MONITORING_TOKEN", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "CONFIG"):
        assert name in page  # listed, with its value masked
    assert secret not in page and settings.SECRET_KEY not in page
