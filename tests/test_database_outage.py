"""Database outages, with real processes whose database connections go through a proxy the test cuts:
callers get a 503 that says to retry, and everything works again once the database is back, with
no restart.

PostgreSQL only: SQLite is a file the processes open themselves, with no connection to cut.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import pytest
from django.db import connection
from django.test import Client

from finetuning.models import JobStatus
from tests.file_uploads import upload
from tests.fine_tuning_jobs import wait_for
from tests.inference_fixtures import BASE, monitoring_headers
from tests.personas import good_dataset
from tests.processes import celery_worker_command, free_port, redis_server, running, running_web
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
        health = httpx.get(f"{url}/healthz", headers=monitoring_headers(), timeout=30)
        assert health.status_code == 503 and "database" in health.json()["down"], health.text

        proxied_database.proxy.restore()
        for path in API_READS:
            assert api.get(path).status_code == 200, path
        assert signed_in.get("/jobs").status_code == 200
        assert "database" not in httpx.get(f"{url}/healthz", headers=monitoring_headers(), timeout=30).json()["down"]


def test_a_trainer_cut_off_from_the_database_mid_training_waits_for_it_and_the_job_succeeds(
    alice, proxied_database, test_database_url, tmp_path
):
    # A broker of the test's own: the session's worker (if an earlier test started it) must not take the job.
    port = free_port()
    broker = {"REDIS_URL": f"redis://127.0.0.1:{port}/0"}
    file_id = upload(alice, good_dataset(12)).json()["id"]
    trainer = celery_worker_command("training", "trainer-proxied-database")
    with (
        redis_server(port, tmp_path),
        running_web("web-own-redis", {**broker, "DATABASE_URL": test_database_url}) as url,
        running("trainer-proxied-database", trainer, {**broker, "DATABASE_URL": proxied_database.url}),
    ):
        hyperparameters = {"n_epochs": 2, "batch_size": 4}  # 6 steps, a checkpoint after the third
        body = {"model": BASE, "training_file": file_id, "suffix": "outage", "hyperparameters": hyperparameters}
        response = httpx.post(f"{url}/v1/fine_tuning/jobs", json=body, headers={"Authorization": f"Bearer {alice.key}"})
        assert response.status_code == 200, response.text
        job_id = response.json()["id"]
        wait_for(job_id, lambda job: job.events.filter(type="metrics").exists())  # it has just begun

        # Both its connections (the trainer's and its heartbeat's) break, whatever it is doing.
        proxied_database.proxy.cut()
        time.sleep(5)
        proxied_database.proxy.restore()
        job = wait_for(job_id, lambda job: job.is_finished, timeout_s=240)

    assert job.status == JobStatus.SUCCEEDED and job.attempts == 1, job.error_message
    steps = {event.data["step"] for event in job.events.filter(type="metrics")}
    assert steps == set(range(1, 7)), "a step's event was lost in the outage"
