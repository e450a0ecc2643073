"""Helpers for tests of the tenant limits: counters of their own, and limits lowered for a test."""

from __future__ import annotations

import dataclasses
import secrets

import pytest
import redis
from django.conf import settings


@pytest.fixture(autouse=True)
def own_counters(monkeypatch):
    """Each test counts under a Redis prefix of its own, and deletes only its own keys afterwards
    (the test Redis database is shared with the Celery broker and with other test runs)."""
    prefix = f"test-limits:{secrets.token_hex(4)}:"
    monkeypatch.setattr("core.rate_limits.KEY_PREFIX", prefix)
    url = settings.CONFIG.redis_url  # now: a test may point the platform at a Redis that is down
    yield prefix
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(f"{prefix}*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def end_windows(prefix: str, window_s: int) -> None:
    """The current window of every counter under ``prefix`` ends now: what waiting ``window_s``
    would do, without a test that a busy machine can outlast (each counter must expire within its
    window, which is what ends it in production)."""
    client = redis.Redis.from_url(settings.CONFIG.redis_url)
    try:
        keys = list(client.scan_iter(f"{prefix}*"))
        assert keys, "no counters to end"
        for key in keys:
            assert 0 < client.pttl(key) <= window_s * 1000, f"{key!r} does not end with its window"
            client.delete(key)
    finally:
        client.close()


def lower_limits(django_settings, **limits) -> None:
    """Set some of ``settings.CONFIG.limits`` for one test (``django_settings``: pytest-django's fixture)."""
    config = django_settings.CONFIG
    django_settings.CONFIG = dataclasses.replace(config, limits=dataclasses.replace(config.limits, **limits))
