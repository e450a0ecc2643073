"""Liveness checks for each part the platform needs; each returns what a person should know."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.db import connection

from base.celery import REQUIRED_QUEUES, queue_consumers
from base.serving_client import PoolUnavailable, backends, pool_health, ray_health
from core.redis_ping import redis_problem

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


_workers_seen: int | None = None  # how many answered last time: the next check waits for that many


def workers() -> CheckResult:
    """Up when every queue the platform sends to has a worker consuming it: a job sent to a queue
    that nobody reads would wait for ever."""
    global _workers_seen
    try:
        consumers = queue_consumers(settings.CELERY_BROKER_URL, TIMEOUT_S, expect_workers=_workers_seen)
        if _workers_seen and _unread(consumers):  # one may have gone and another come: hear them all
            consumers = queue_consumers(settings.CELERY_BROKER_URL, TIMEOUT_S)
    except Exception as exc:  # the broker is down: broker() reports it, this says why no worker
        return CheckResult(False, f"cannot reach workers: {exc}")
    _workers_seen = len({worker for names in consumers.values() for worker in names}) or None
    if not consumers:
        return CheckResult(False, "no worker answered (start one: celery -A workers worker)")
    unread = _unread(consumers)
    if unread:
        listed = ", ".join(map(repr, unread))
        return CheckResult(
            False,
            f"no worker consumes the queue(s) {listed} (start one: celery -A workers worker --queues {','.join(unread)})",
        )
    return CheckResult(True, "; ".join(f"{queue}: {', '.join(consumers[queue])}" for queue in REQUIRED_QUEUES))


def _unread(consumers: dict[str, list[str]]) -> list[str]:
    return [queue for queue in REQUIRED_QUEUES if queue not in consumers]


def inference_pool() -> CheckResult:
    """The replicas of each backend the catalog's models use: the embedded pool, Ray Serve."""
    used = backends()
    results = [check() for backend, check in (("embedded", _embedded_pool), ("ray", _ray_serve)) if backend in used]
    return CheckResult(all(result.ok for result in results), "; ".join(result.detail for result in results))


def _ray_serve() -> CheckResult:
    try:
        _, body = ray_health()
    except PoolUnavailable as exc:
        return CheckResult(False, f"Ray Serve: {exc}")
    states = ", ".join(
        f"{model} {state['state']}, {state['ready_replicas']} ready" for model, state in body["models"].items()
    )
    return CheckResult(True, f"Ray Serve: {states}")


def _embedded_pool() -> CheckResult:
    try:
        status, body = pool_health()
    except PoolUnavailable as exc:
        return CheckResult(False, str(exc))
    if status != 200:  # the pool answers 200 while each model runs or is scaled to zero by choice
        return CheckResult(False, f"inference pool: {body.get('detail', 'no replica is ready')}")
    idle = [f"{model} ({state['state']})" for model, state in body.get("models", {}).items()
            if state.get("state") in ("asleep", "cold")]
    scaled = f"; scaled to zero (wake or start on their next request): {', '.join(idle)}" if idle else ""
    return CheckResult(True, f"{body.get('ready_replicas', 0)} replica(s) ready{scaled}{_lora_kernels(body)}")


def _lora_kernels(body: dict) -> str:
    """Which LoRA kernels the ready replicas run, and how they serve mixes; where ours were asked for
    but vLLM's run, why (mixes are built as adapters there)."""
    shown = set()
    for replica in body.get("replicas", []):
        kernels = replica.get("lora_kernels") if replica.get("healthy") else None
        if kernels:
            fell_back = kernels.get("active") != kernels.get("requested")
            mixes = "mixes in the kernel" if kernels.get("mixes_in_kernel") else "mixes built as adapters"
            shown.add(
                f"{kernels.get('active')} ({kernels.get('reason')})"
                if fell_back
                else f"{kernels.get('active')}, {mixes}"
            )
    return f"; LoRA kernels: {', '.join(sorted(shown))}" if shown else ""


ALL_CHECKS = {"database": database, "redis": broker, "workers": workers, "inference_pool": inference_pool}
