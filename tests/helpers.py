"""Helpers that test modules share and that have no themed module of their own (see the other
modules of tests/ for those: file_uploads, fine_tuning_jobs, adapter_archives, fake_pool, ...).

Import a fixture by name into the test module that uses it (its name lands in that module, which is
how pytest finds it); nothing here is a fixture for every test."""

from __future__ import annotations

import pytest
from django.apps import apps

from finetuning.models import JobEvent
from tests.processes import running_web


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def web_without_broker(test_database_url):
    """The web process as bin/run serves it, on the test database, with its broker down."""
    environment = {"DATABASE_URL": test_database_url, "REDIS_URL": "redis://127.0.0.1:9/0"}  # nothing listens
    with running_web("web-without-broker", environment) as url:
        yield url


def tenant_rows() -> int:
    """Rows of every table a tenant's request could write to. Not job events: the session's worker
    adds them to the fuzz's own queued jobs at any moment (the sweeper says what each waits for),
    which would count as a write of whatever request it lands in."""
    labels = ("finetuning", "evals", "batches", "accounts", "auth", "webhooks", "training_loops")
    tables = [model for label in labels for model in apps.get_app_config(label).get_models() if model is not JobEvent]
    return sum(model.objects.count() for model in tables)
