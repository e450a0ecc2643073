"""Compositions built on a worker: ``svd``, ``ties`` and ``dare_linear`` take seconds of both cores
for a few rank-16 parents, too long for a web request; ``linear`` (a concatenation) stays in it.

``compose`` checks everything that needs no weight read (``finetuning.compose.plan_composition``:
parents, name, rank, the result's size against the storage quota), then either builds a ``linear``
composition at once or creates a ``Composition`` (queued) and, once that is committed, sends its id
to the ``default`` queue. A composition's status moves only here, each time with a conditional
update, so two deliveries of one task cannot both build it: queued -> running (``claim``) ->
succeeded (``succeed``) or failed (``fail``).

Per organization, at most COMPOSITIONS_AT_ONCE_PER_ORGANIZATION compositions are queued or running
(counted under the organization's lock, so two requests cannot both take the last slot), and at
most COMPOSITIONS_PER_HOUR_PER_ORGANIZATION compositions of any method are made an hour (a Redis
rate, as uploads have); over either, a 429 says when to try again.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import cast

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone
from kombu.exceptions import OperationalError

from accounts.locks import lock_organization
from accounts.models import Organization
from base.celery import COMPOSE_MODEL, send
from core.api_errors import ApiError
from core.config import LIMIT_SETTINGS
from core.lora_merge import Method
from core.model_names import parse_model_name
from core.rate_limits import RATE_LIMIT_TYPE
from finetuning import compose, quotas
from finetuning.models import Composition, CompositionStatus, FineTunedModel

log = logging.getLogger(__name__)

# A composition of the most parents at the served rank takes tens of seconds on two cores: a caller
# refused for the compositions under way is told to look again after about that long.
RETRY_AT_ONCE_S = 30
# Past this a running composition's worker is gone (the task's hard time limit is shorter:
# ``workers.tasks``); the sweeper fails it, so it stops holding a slot and its name.
LOST_AFTER = timedelta(minutes=20)


def compose_or_queue(
    organization: Organization, user: User | None, request: compose.CompositionRequest
) -> FineTunedModel | Composition:
    """The published model for ``linear``; for the other methods, the queued ``Composition``."""
    plan = compose.plan_composition(organization, request)
    if plan.method == "linear":
        _charge_hourly(organization)
        return compose.build_composition(organization, plan)
    return _queue(organization, user, plan)


def _queue(organization: Organization, user: User | None, plan: compose.Plan) -> Composition:
    with transaction.atomic():
        lock_organization(organization.pk)  # until the commit: the count below stays true
        _check_at_once(organization)
        _charge_hourly(organization)
        composition = Composition.objects.create(
            organization=organization, created_by=user, model=str(plan.name),
            parents=[{"model": model, "scale": scale} for model, scale in plan.scales.items()],
            method=plan.method, rank=plan.rank, density=plan.density, seed=plan.seed,
            estimated_bytes=plan.estimated_bytes,
        )
        # Only after the commit can a worker see it; a rolled-back composition is never sent.
        transaction.on_commit(lambda: _send_or_503(composition))
    return composition


def _check_at_once(organization: Organization) -> None:
    cap = settings.CONFIG.limits.compositions_at_once_per_organization
    under_way = Composition.objects.for_org(organization).unfinished().count()
    if under_way >= cap:
        raise ApiError(
            f"{organization.name} already has {under_way} compositions queued or running, its limit "
            f"({LIMIT_SETTINGS['compositions_at_once_per_organization']}). Try again in about {RETRY_AT_ONCE_S} s, once "
            "one has finished (GET /v1/fine_tuning/compositions lists them).",
            status=429, type=RATE_LIMIT_TYPE, param="method", code="too_many_compositions",
            retry_after_s=RETRY_AT_ONCE_S,
        )


def _charge_hourly(organization: Organization) -> None:
    quotas.charge_hourly(organization, "compositions", "compositions_per_hour_per_organization", param="parents")


def send_to_worker(composition_id: str) -> None:
    """Wake a worker for a queued composition. Sending twice is harmless: only one ``claim`` wins."""
    send(COMPOSE_MODEL, composition_id)


def _send_or_503(composition: Composition) -> None:
    try:
        send_to_worker(composition.id)
    except OperationalError as exc:  # the broker is down: nothing was done, and nothing will be
        log.warning("composition %s could not be sent to a worker: %s", composition.id, exc)
        message = "The task broker was unreachable, so no worker was told; nothing was built. Compose it again."
        fail(composition.id, "broker_unavailable", message)
        raise ApiError(
            f"Composition {composition.id} could not be started: the task broker is unreachable. Nothing was built "
            "and its suffix is free again; compose it again shortly.",
            status=503, code="broker_unavailable", retry_after_s=5,
        ) from None


def plan_of(composition: Composition) -> compose.Plan:
    """The plan a composition was created with, as its worker builds it."""
    return compose.Plan(
        name=parse_model_name(composition.model),
        scales={parent["model"]: parent["scale"] for parent in composition.parents},
        method=cast(Method, composition.method),  # one of METHODS: checked at creation
        rank=composition.rank, density=composition.density, seed=composition.seed,
        estimated_bytes=composition.estimated_bytes,
    )


def claim(composition_id: str, worker: str) -> Composition | None:
    """queued -> running, for exactly one worker; None when it runs elsewhere or has finished."""
    queued = Composition.objects.filter(pk=composition_id, status=CompositionStatus.QUEUED)
    if not queued.update(status=CompositionStatus.RUNNING, worker=worker, started_at=timezone.now()):
        return None
    return Composition.objects.select_related("organization").get(pk=composition_id)


def succeed(composition_id: str, model: FineTunedModel) -> bool:
    """running -> succeeded; False when it was failed meanwhile (given up on as lost)."""
    assert model.composition is not None
    running = Composition.objects.filter(pk=composition_id, status=CompositionStatus.RUNNING)
    error = model.composition["approximation_error"]
    return bool(
        running.update(status=CompositionStatus.SUCCEEDED, approximation_error=error, finished_at=timezone.now())
    )


def fail(composition_id: str, code: str, message: str) -> bool:
    """queued or running -> failed, with the reason the user reads; its name is free again."""
    return bool(
        Composition.objects.unfinished()
        .filter(pk=composition_id)
        .update(status=CompositionStatus.FAILED, error_code=code, error_message=message, finished_at=timezone.now())
    )


def fail_lost() -> list[str]:
    """Fail the compositions running for longer than any worker may (its worker died): for the sweeper."""
    lost = Composition.objects.filter(status=CompositionStatus.RUNNING, started_at__lt=timezone.now() - LOST_AFTER)
    message = "The worker building this composition stopped responding; nothing was published. Compose it again."
    return [
        composition_id
        for composition_id in lost.values_list("pk", flat=True)
        if fail(composition_id, "worker_lost", message)
    ]
