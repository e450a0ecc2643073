# ruff: noqa: F811 (pytest fixtures are imported, then named as arguments)
"""Dashboard sign-in: refused, before the password is checked, after too many failures for one
username or from one address, until the window ends; a success clears the username's failures."""

from __future__ import annotations

import time

import pytest
from django.urls import reverse

from tests.limits import lower_limits, own_counters  # noqa: F401 (a fixture)

pytestmark = pytest.mark.django_db

WINDOW_S = 3


def _sign_in(client, username: str, password: str, address: str = "192.0.2.1"):
    return client.post(reverse("dashboard:login"), {"username": username, "password": password}, REMOTE_ADDR=address)


@pytest.fixture
def strict(settings):
    lower_limits(settings, sign_in_failures=3, sign_in_window_s=WINDOW_S)


def test_it_refuses_sign_in_after_too_many_failures_and_allows_it_again_after_the_window(client, alice, strict):
    started = time.monotonic()
    assert [_sign_in(client, "alice", "wrong").status_code for _ in range(3)] == [200, 200, 200]

    refused = _sign_in(client, "alice", "pw", address="192.0.2.2")  # the right password, from elsewhere
    assert refused.status_code == 429 and int(refused["Retry-After"]) <= WINDOW_S
    assert "Too many sign-in attempts" in refused.content.decode()
    assert "_auth_user_id" not in client.session

    time.sleep(max(0.0, WINDOW_S - (time.monotonic() - started)) + 0.2)
    signed_in = _sign_in(client, "alice", "pw", address="192.0.2.2")
    assert signed_in.status_code == 302 and client.session["_auth_user_id"] == str(alice.user.pk)


def test_it_refuses_an_address_that_failed_too_often_whatever_the_username(client, alice, strict):
    for username in ("root", "admin", "bob"):
        assert _sign_in(client, username, "guess").status_code == 200
    assert _sign_in(client, "alice", "pw").status_code == 429
    assert _sign_in(client, "alice", "pw", address="192.0.2.9").status_code == 302  # another address


def test_it_clears_a_usernames_failures_when_its_sign_in_succeeds(client, alice, strict):
    for _ in range(2):
        assert _sign_in(client, "alice", "wrong", address="192.0.2.3").status_code == 200
    assert _sign_in(client, "alice", "pw", address="192.0.2.4").status_code == 302
    client.logout()
    for _ in range(3):  # a fresh count: three more failures before a refusal
        assert _sign_in(client, "alice", "wrong", address="192.0.2.5").status_code == 200
    assert _sign_in(client, "alice", "pw", address="192.0.2.6").status_code == 429
