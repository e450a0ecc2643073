"""Shared fixtures: real worker and inference-pool processes, started once per test session."""

from __future__ import annotations

import os
import signal
import sys
from urllib.parse import quote

import pytest
from django.db import connection

from tests.inference_fixtures import internal_headers, pool_environment
from tests.processes import answers, celery_worker_command, running, wait_until
from server.celery import app as celery_app

pytest_plugins = ["tests.personas", "tests.browser"]

# Celery reads its settings once, lazily: read them now, before a test overrides Django settings.
_ = celery_app.conf.broker_url


def _url_of(settings_dict: dict) -> str:
    """A DATABASE_URL for the test database, so worker processes open the same one."""
    if connection.vendor == "sqlite":
        return f"sqlite:///{settings_dict['NAME']}"
    user = quote(settings_dict.get("USER") or "")
    password = f":{quote(settings_dict['PASSWORD'])}" if settings_dict.get("PASSWORD") else ""
    port = f":{settings_dict['PORT']}" if settings_dict.get("PORT") else ""
    return f"postgres://{user}{password}@{settings_dict.get('HOST') or 'localhost'}{port}/{settings_dict['NAME']}"


@pytest.fixture(scope="session", autouse=True)
def _database_left_free(django_db_setup, django_db_blocker):
    """End the test database's other sessions before it is dropped: the gateway's ORM calls run in
    asgiref's shared threads, which keep their connections (by design) until the process exits."""
    yield
    if connection.vendor != "postgresql":
        return
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )


@pytest.fixture(scope="session")
def test_database_url(django_db_setup) -> str:
    return _url_of(connection.settings_dict)


class Worker:
    """A real Celery worker process on the test broker and database; tests may kill and restart it."""

    def __init__(self, database_url: str):
        self.env = {"DATABASE_URL": database_url}
        self.process = None
        self._running = None

    def start(self) -> None:
        self._running = running("worker", celery_worker_command(), self.env)
        self.process = self._running.__enter__()
        wait_until(lambda: bool(celery_app.control.ping(timeout=0.5, limit=1)), 60, "celery worker", self.process)

    def stop(self) -> None:
        if self._running is not None:
            self._running.__exit__(None, None, None)
            self._running = None

    def kill(self) -> None:
        """Die as a crashed machine would: SIGKILL, no chance to finish or acknowledge anything."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.stop()


@pytest.fixture(scope="session")
def celery_worker(test_database_url):
    """Tests that hand it work must commit their rows: mark them django_db(transaction=True)."""
    celery_app.control.purge()  # a task left by an aborted earlier run must not run now
    worker = Worker(test_database_url)
    worker.start()
    yield worker
    worker.stop()


@pytest.fixture(scope="session")
def inference_pool():
    """The real inference pool with one vLLM (CPU) replica of the default base model (test catalog)."""
    from django.conf import settings

    with running("pool", [sys.executable, "-m", "inference"], pool_environment()) as process:
        health = f"{settings.INFERENCE_POOL_URL}/health"
        wait_until(lambda: answers(health, headers=internal_headers()), 300, "inference pool", process)
        yield settings.INFERENCE_POOL_URL


def pytest_collection_modifyitems(items: list) -> None:
    """The running product's tests first: bin/run starts an engine of its own, and it must not share
    the two cores with the session's engine, which starts lazily with the first test that needs it."""
    items.sort(key=lambda item: item.get_closest_marker("product") is None)


@pytest.fixture
def not_queued(monkeypatch):
    """For tests that run or recover a job themselves: it is never queued, so the session's worker
    (alive if an earlier test started it) cannot take it first."""
    monkeypatch.setattr("finetuning.jobs.send_to_trainer", lambda job_id: None)
