"""Shared fixtures: real worker and inference-pool processes, started once per test session."""

from __future__ import annotations

import sys
from urllib.parse import quote

import httpx
import pytest
from django.db import connection

from tests.inference_fixtures import pool_environment
from tests.processes import celery_worker_command, running, wait_until
from workers.celery_app import app as celery_app

# Celery reads its settings once, lazily: read them now, before a test overrides Django settings.
celery_app.conf.broker_url


def _url_of(settings_dict: dict) -> str:
    """A DATABASE_URL for the test database, so worker processes open the same one."""
    if connection.vendor == "sqlite":
        return f"sqlite:///{settings_dict['NAME']}"
    user = quote(settings_dict.get("USER") or "")
    password = f":{quote(settings_dict['PASSWORD'])}" if settings_dict.get("PASSWORD") else ""
    port = f":{settings_dict['PORT']}" if settings_dict.get("PORT") else ""
    return f"postgres://{user}{password}@{settings_dict.get('HOST') or 'localhost'}{port}/{settings_dict['NAME']}"


@pytest.fixture(scope="session")
def test_database_url(django_db_setup) -> str:
    return _url_of(connection.settings_dict)


@pytest.fixture(scope="session")
def celery_worker(test_database_url):
    """A real Celery worker process consuming the test broker, on the test database.

    Tests that hand it work must commit their rows: mark them django_db(transaction=True).
    """
    celery_app.control.purge()  # a task left by an aborted earlier run must not run now
    with running("worker", celery_worker_command(), {"DATABASE_URL": test_database_url}) as process:
        wait_until(lambda: bool(celery_app.control.ping(timeout=0.5, limit=1)), 60, "celery worker", process)
        yield process


@pytest.fixture(scope="session")
def inference_pool():
    """The real inference pool with one vLLM (CPU) replica of the default base model (test catalog)."""
    from django.conf import settings

    def ready() -> bool:
        try:
            return httpx.get(f"{settings.INFERENCE_POOL_URL}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    with running("pool", [sys.executable, "-m", "inference"], pool_environment()) as process:
        wait_until(ready, 300, "inference pool", process)
        yield settings.INFERENCE_POOL_URL
