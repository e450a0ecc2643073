# ruff: noqa: F811 (pytest fixtures are imported, then named as arguments)
"""Dashboard sign-in: refused, before the password is checked, after too many failures for one
username or from one address, until the window ends; a success clears the username's failures."""

from __future__ import annotations

import httpx
import pytest
from django.urls import reverse

from tests.limits import end_windows, lower_limits, own_counters  # noqa: F401 (a fixture)

pytestmark = pytest.mark.django_db

WINDOW_S = 60


def _sign_in(client, username: str, password: str, address: str = "192.0.2.1"):
    return client.post(reverse("dashboard:login"), {"username": username, "password": password}, REMOTE_ADDR=address)


@pytest.fixture
def strict(settings):
    lower_limits(settings, sign_in_failures=3, sign_in_window_s=WINDOW_S)


def test_it_refuses_sign_in_after_too_many_failures_and_allows_it_again_after_the_window(
    client, alice, strict, own_counters  # noqa: F811
):
    assert [_sign_in(client, "alice", "wrong").status_code for _ in range(3)] == [200, 200, 200]

    refused = _sign_in(client, "alice", "pw", address="192.0.2.2")  # the right password, from elsewhere
    assert refused.status_code == 429 and int(refused["Retry-After"]) <= WINDOW_S
    assert "Too many sign-in attempts" in refused.content.decode()
    assert "_auth_user_id" not in client.session

    end_windows(own_counters, WINDOW_S)
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


@pytest.fixture
def behind_a_proxy():
    """The web application as uvicorn serves it: its proxy-header layer trusts X-Forwarded-For from
    FORWARDED_ALLOW_IPS (127.0.0.1 by default), a TLS proxy on the same machine."""
    from django.core.asgi import get_asgi_application
    from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

    application = ProxyHeadersMiddleware(get_asgi_application(), trusted_hosts="127.0.0.1")

    def client_from(peer: str) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=application, client=(peer, 40000))
        return httpx.AsyncClient(transport=transport, base_url="http://testserver")

    return client_from


async def _sign_in_through(client: httpx.AsyncClient, username: str, forwarded_for: str) -> int:
    page = await client.get(reverse("dashboard:login"))
    token = page.cookies["csrftoken"]
    form = {"username": username, "password": "guess", "csrfmiddlewaretoken": token}
    response = await client.post(reverse("dashboard:login"), data=form, headers={"X-Forwarded-For": forwarded_for})
    return response.status_code


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
@pytest.mark.django_db(transaction=True)
async def test_behind_a_proxy_on_the_same_machine_each_client_address_has_its_own_count(behind_a_proxy, strict):
    async with behind_a_proxy("127.0.0.1") as proxy:
        assert [await _sign_in_through(proxy, name, "198.51.100.7") for name in ("root", "admin", "bob")] == [200] * 3
        assert await _sign_in_through(proxy, "carol", "198.51.100.7") == 429
        assert await _sign_in_through(proxy, "carol", "198.51.100.8") == 200  # another client behind the same proxy
    # A caller that is not the trusted proxy cannot pick its address with the header.
    async with behind_a_proxy("203.0.113.5") as stranger:
        assert [await _sign_in_through(stranger, "dave", f"198.51.100.{i}") for i in (20, 21, 22, 23)] == [200] * 3 + [429]
