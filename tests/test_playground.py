"""The dashboard's playground against the real web process (uvicorn, ASGI) and the real pool.

A signed-in session stands in for an API key; the answer must arrive as a stream of server-sent
events, piece by piece, exactly as the public API streams it.
"""

# ruff: noqa: F811 (pytest fixtures are imported from tests.inference_fixtures, then named as arguments)
from __future__ import annotations

import json

import httpx
import pytest
from django.test import Client

from tests.inference_fixtures import (  # noqa: F401 (fixtures)
    BASE,
    gateway,
    make_adapter,
    monitoring_headers,
    publish_fine_tuned_model,
)

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]


def browser_session(site: str, persona) -> httpx.Client:
    """What a browser holds after signing in: the session cookie and a CSRF token."""
    django_client = Client()
    django_client.force_login(persona.user)  # the session row is committed; the web process reads it
    session = httpx.Client(base_url=site, cookies={"sessionid": django_client.cookies["sessionid"].value}, timeout=120)
    assert session.get("/playground").status_code == 200  # sets the csrftoken cookie, as the page load does
    session.headers["X-CSRFToken"] = session.cookies["csrftoken"]
    return session


def stream_chat(session: httpx.Client, model: str, prompt: str) -> tuple[list[str], list[dict]]:
    """The answer's text pieces, in arrival order, and every event."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "temperature": 0}
    pieces, events = [], []
    with session.stream("POST", "/playground/chat", json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            events.append(event)
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                pieces.append(event["choices"][0]["delta"]["content"])
    return pieces, events


def test_a_fine_tuned_models_answer_streams_into_the_playground(gateway, alice, make_adapter):
    model = publish_fine_tuned_model(alice, "playground", make_adapter(seed=21))
    session = browser_session(gateway, alice)

    pieces, events = stream_chat(session, model, "Name three colours.")

    assert len(pieces) >= 2 and "".join(pieces).strip()
    metrics = session.get("/metrics", headers=monitoring_headers()).text
    assert 'fineserve_gateway_requests_total{endpoint="playground",status="200"}' in metrics
    assert {event["model"] for event in events} == {f"{model}@r1"}  # the revision that answered
    assert events[-1]["usage"]["completion_tokens"] >= len(pieces)  # the page shows tokens/s from this


def test_the_models_page_shows_a_fine_tuned_model_loaded_once_it_has_answered(gateway, alice, make_adapter):
    model = publish_fine_tuned_model(alice, "shown-loaded", make_adapter(seed=22))
    session = browser_session(gateway, alice)

    def serving_cell() -> str:
        page = session.get("/models").text
        row = page[page.index(f'data-model="{model}"'):]
        return row[row.index('class="serving-cell"'): row.index("</td>", row.index('class="serving-cell"'))]

    assert "not loaded" in serving_cell()
    stream_chat(session, model, "Hello")
    assert "loaded on 1 replica" in serving_cell()


def test_another_organizations_fine_tuned_model_is_not_found_from_the_playground(gateway, alice, charlie, make_adapter):
    model = publish_fine_tuned_model(charlie, "not-alices", make_adapter(seed=23))
    response = browser_session(gateway, alice).post(
        "/playground/chat", json={"model": model, "messages": [{"role": "user", "content": "Hello"}]}
    )
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
