"""Database outages, with real processes whose database connections go through a proxy the test cuts:
callers get a 503 that says to retry, and everything works again once the database is back, with
no restart.

PostgreSQL only: SQLite is a file the processes open themselves, with no connection to cut.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import pytest
from django.db import connection
from django.test import Client

from tests.processes import running_web
from tests.tcp_proxy import TcpProxy, tcp_proxy

pytestmark = [
    pytest.mark.fault,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="needs PostgreSQL: SQLite has no connection to cut"),
]

API_READS = ("/v1/fine_tuning/jobs", "/v1/files", "/v1/models")  # DRF views, and the gateway's async view


@dataclass
class ProxiedDatabase:
    proxy: TcpProxy
    url: str  # the test database's DATABASE_URL, through the proxy


@pytest.fixture
def proxied_database(test_database_url) -> Iterator[ProxiedDatabase]:
    url = urlsplit(test_database_url)
    with tcp_proxy(url.hostname, url.port or 5432) as proxy:
        user = url.netloc.rpartition("@")[0]
        yield ProxiedDatabase(proxy, url._replace(netloc=f"{user}@127.0.0.1:{proxy.port}").geturl())


def assert_database_unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert int(response.headers["Retry-After"]) > 0
    error = response.json()["error"]
    assert error["code"] == "database_unavailable" and "retry" in error["message"], error
    assert set(error) >= {"message", "type", "param", "code"}


def test_it_answers_503_to_retry_while_the_database_is_unreachable_and_200_once_it_is_back(alice, proxied_database):
    browser = Client()
    browser.force_login(alice.user)  # the session row is committed; the web process reads it
    with running_web("web-proxied-database", {"DATABASE_URL": proxied_database.url}) as url:
        api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {alice.key}"}, timeout=30)
        signed_in = httpx.Client(base_url=url, cookies={"sessionid": browser.cookies["sessionid"].value}, timeout=30)
        for path in API_READS:
            assert api.get(path).status_code == 200, path

        proxied_database.proxy.cut()
        for path in API_READS:
            assert_database_unavailable(api.get(path))
        # Completions are served before Django's middleware (the ASGI fast path): the same answer.
        assert_database_unavailable(api.post("/v1/chat/completions", json={"model": "any", "messages": []}))
        page = signed_in.get("/jobs")
        assert page.status_code == 503 and "Retry-After" in page.headers and "retry" in page.text, page.text
        health = httpx.get(f"{url}/healthz", timeout=30)
        assert health.status_code == 503 and "database" in health.json()["down"], health.text

        proxied_database.proxy.restore()
        for path in API_READS:
            assert api.get(path).status_code == 200, path
        assert signed_in.get("/jobs").status_code == 200
        assert "database" not in httpx.get(f"{url}/healthz", timeout=30).json()["down"]
