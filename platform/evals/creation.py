"""Creating evals and starting their runs: everything that can refuse is checked first (the file,
the graders in the sandbox's process, every model the caller names), then the rows are written and,
once committed, each run's id is sent to the ``default`` queue (``workers.run_eval`` scores it).
A refusal writes nothing and queues nothing."""

from __future__ import annotations

import logging

from django.contrib.auth.models import User
from django.db import transaction
from kombu.exceptions import OperationalError

from accounts.locks import lock_organization
from accounts.models import Organization
from answering.access import usable_target
from answering.batch import Sampling, Target
from base.celery import RUN_EVAL, send
from core.api_errors import ApiError
from core.rate_limits import RATE_LIMIT_TYPE
from evals import run_status, sources
from evals.criteria import checked_criteria
from evals.models import Eval, EvalRun
from evals.requests import EvalCreate, RunCreate

log = logging.getLogger(__name__)

RUNS_AT_ONCE_PER_ORGANIZATION = 16  # queued or in progress: each holds the engine for a while
RETRY_AT_ONCE_S = 30


def create_eval(organization: Organization, user: User | None, request: EvalCreate) -> Eval:
    criteria = checked_criteria(request.testing_criteria)
    item_count = sources.usable_file(organization, request.file, "file")
    return Eval.objects.create(
        organization=organization, created_by=user, name=request.name or f"eval of {request.file}",
        file_id=request.file, item_count=item_count, testing_criteria=criteria, metadata=request.metadata,
    )  # fmt: skip


def start_runs(organization: Organization, user: User | None, evaluation: Eval, request: RunCreate) -> list[EvalRun]:
    """One run per model the request names (``data_source.model``, then ``models``), all on the same
    examples and sampling; queued once committed."""
    targets = request.targets()
    if not targets:
        raise ApiError(
            "Name the model to run: data_source.model, or several in models (one run each).",
            param="data_source.model", code="missing_model",
        )  # fmt: skip
    for where, target in targets:
        usable_target(organization, target, where)
    file_id, items = evaluation.file_id, evaluation.item_count
    if request.data_source.source is not None:
        file_id = request.data_source.source.id
        items = sources.usable_file(organization, file_id, "data_source.source.id")
    with transaction.atomic():
        lock_organization(organization.pk)  # until the commit: the count below stays true
        _check_at_once(organization, len(targets))
        runs = [
            _run(organization, user, evaluation, request, target, file_id, items, len(targets))
            for _where, target in targets
        ]
        transaction.on_commit(lambda: _send_or_503(runs))
    return runs


def _run(
    organization: Organization, user: User | None, evaluation: Eval, request: RunCreate, target: Target,
    file_id: str, items: int, of: int,
) -> EvalRun:  # fmt: skip
    name = request.name or target.model
    if request.name and of > 1:
        name = f"{request.name} ({target.model})"
    adapters = [{"model": model, "scale": scale} for model, scale in target.adapters] or None
    return EvalRun.objects.create(
        eval=evaluation, organization=organization, created_by=user, name=name[:256], model=target.model,
        adapters=adapters, file_id=file_id, sampling=_sampling(request.sampling()), metadata=request.metadata,
        total_items=items,
    )  # fmt: skip


def _sampling(sampling: Sampling) -> dict:
    return {
        "max_completion_tokens": sampling.max_completion_tokens, "temperature": sampling.temperature,
        "top_p": sampling.top_p, "seed": sampling.seed,
    }  # fmt: skip


def _check_at_once(organization: Organization, adding: int) -> None:
    under_way = EvalRun.objects.for_org(organization).unfinished().count()
    if under_way + adding > RUNS_AT_ONCE_PER_ORGANIZATION:
        raise ApiError(
            f"{organization.name} has {under_way} eval runs queued or in progress; with {adding} more it would pass "
            f"its limit of {RUNS_AT_ONCE_PER_ORGANIZATION}. Try again in about {RETRY_AT_ONCE_S} s, once some have "
            "finished (or cancel some).",
            status=429, type=RATE_LIMIT_TYPE, code="too_many_eval_runs", retry_after_s=RETRY_AT_ONCE_S,
        )  # fmt: skip


def send_to_worker(run_id: str) -> None:
    """Wake a worker for a queued run. Sending twice is harmless: only one ``claim`` wins."""
    send(RUN_EVAL, run_id)


def _send_or_503(runs: list[EvalRun]) -> None:
    try:
        for run in runs:
            send_to_worker(run.id)
    except OperationalError as exc:  # the broker is down: fail what was not started, say so
        log.warning("eval runs could not be sent to a worker: %s", exc)
        for run in runs:
            run_status.fail(run.id, "broker_unavailable", "The task broker was unreachable, so no worker was told. Start the run again.")
        raise ApiError(
            "The runs could not be started: the task broker is unreachable. Start them again shortly.",
            status=503, code="broker_unavailable", retry_after_s=5,
        ) from None  # fmt: skip
