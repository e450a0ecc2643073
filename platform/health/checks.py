"""Liveness checks for each part the platform needs; each returns what a person should know."""

from __future__ import annotations

from dataclasses import dataclass

from celery import Celery
from django.conf import settings
from django.db import connection

from core.redis_ping import redis_problem
from gateway.pool_status import PoolUnavailable, pool_health

TIMEOUT_S = 1.0


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    detail: str


def database() -> CheckResult:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as exc:  # any driver error means "down"; the message says which
        return CheckResult(False, f"{connection.vendor}: {exc}")
    return CheckResult(True, connection.vendor)


def broker() -> CheckResult:
    problem = redis_problem(settings.CELERY_BROKER_URL, TIMEOUT_S)
    return CheckResult(problem is None, problem or "redis")


def workers() -> CheckResult:
    # A throwaway app asks the broker that settings name now, and a failed connection cannot
    # linger in the shared app's pools.
    probe = Celery(broker=settings.CELERY_BROKER_URL, set_as_current=False)
    try:
        replies = probe.control.ping(timeout=TIMEOUT_S, limit=1)
    except Exception as exc:  # the broker is down: broker() reports it, this says why no worker
        return CheckResult(False, f"cannot reach workers: {exc}")
    finally:
        probe.close()
    names = sorted(name for reply in replies for name in reply)
    if not names:
        return CheckResult(False, "no worker answered (start one: celery -A workers worker)")
    return CheckResult(True, ", ".join(names))


def inference_pool() -> CheckResult:
    try:
        status, body = pool_health()
    except PoolUnavailable as exc:
        return CheckResult(False, str(exc))
    ready = body.get("ready_replicas", 0)
    if status != 200 or not ready:
        return CheckResult(False, f"inference pool: {body.get('detail', 'no replica is ready')}")
    return CheckResult(True, f"{ready} replica(s) ready")


ALL_CHECKS = {"database": database, "redis": broker, "workers": workers, "inference_pool": inference_pool}
