"""Creating a batch: its file must be the organization's, uploaded with purpose "batch" (and so
checked line by line at upload: ``core.batch_input``), and fit the organization's batch queue (its
unfinished batches, and their prompt tokens); then the row is written and, once committed, its id
is sent to the ``batch`` queue (``workers.run_batch`` answers it). A refusal writes nothing."""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone
from kombu.exceptions import OperationalError

from accounts.locks import lock_organization
from accounts.models import Organization
from base.celery import RUN_BATCH, send
from batches.models import UNFINISHED_BATCH_STATUSES, Batch
from batches.requests import BatchCreate
from core.api_errors import ApiError, not_found
from core.config import LIMIT_SETTINGS
from core.rate_limits import RATE_LIMIT_TYPE
from finetuning.files import BATCH_PURPOSE
from finetuning.models import File

log = logging.getLogger(__name__)

COMPLETION_WINDOW = timedelta(hours=24)
BATCHES_AT_ONCE_PER_ORGANIZATION = 16  # unfinished: each holds a share of the batch queue for a while
RETRY_AT_ONCE_S = 60


def create_batch(organization: Organization, user: User | None, request: BatchCreate) -> Batch:
    file = File.objects.for_org(organization).filter(pk=request.input_file_id).first()
    if file is None:
        raise not_found("file", request.input_file_id, param="input_file_id")
    if file.purpose != BATCH_PURPOSE:
        raise ApiError(
            f"File {file.id} was uploaded with purpose '{file.purpose}'; a batch's requests are a file uploaded "
            f"with purpose '{BATCH_PURPOSE}' (checked line by line then).",
            param="input_file_id", code="invalid_file",
        )
    with transaction.atomic():
        lock_organization(organization.pk)  # until the commit: the counts below stay true
        _check_queue(organization, file)
        batch = Batch.objects.create(
            organization=organization, created_by=user, input_file_id=file.id, endpoint=request.endpoint,
            completion_window=request.completion_window, metadata=request.metadata, total=file.example_count,
            expires_at=timezone.now() + COMPLETION_WINDOW,
        )
        transaction.on_commit(lambda: send_to_worker(batch.pk))
    return batch


def _check_queue(organization: Organization, file: File) -> None:
    limit = settings.CONFIG.limits.batch_queue_tokens_per_organization
    setting = LIMIT_SETTINGS["batch_queue_tokens_per_organization"]
    if file.token_count > limit:
        raise ApiError(
            f"File {file.id} holds about {file.token_count:,} prompt tokens, more than an organization may have "
            f"queued in batches ({limit:,}, {setting}): split it into smaller batches.",
            param="input_file_id", code="batch_too_large",
        )
    under_way = Batch.objects.for_org(organization).filter(status__in=UNFINISHED_BATCH_STATUSES)
    inputs = list(under_way.values_list("input_file_id", flat=True))  # a file in two batches counts twice
    if len(inputs) >= BATCHES_AT_ONCE_PER_ORGANIZATION:
        raise _queue_full(f"{organization.name} has {len(inputs)} batches not finished, its limit")
    tokens = dict(File.objects.filter(pk__in=inputs).values_list("pk", "token_count"))
    queued = sum(tokens.get(file_id, 0) for file_id in inputs)
    if queued + file.token_count > limit:
        raise _queue_full(
            f"{organization.name}'s unfinished batches hold about {queued:,} prompt tokens; this one's "
            f"{file.token_count:,} would pass its limit of {limit:,} ({setting})",
            code="batch_queue_full",
        )


def _queue_full(why: str, code: str = "too_many_batches") -> ApiError:
    return ApiError(
        f"{why}. Try again in about {RETRY_AT_ONCE_S} s, once one has finished (or cancel one).",
        status=429, type=RATE_LIMIT_TYPE, code=code, retry_after_s=RETRY_AT_ONCE_S,
    )


def send_to_worker(batch_id: str) -> None:
    """Wake a batch worker. Sending twice is harmless (only one claim wins); a broker that is down
    loses nothing: the sweeper sends again a batch whose message it does not hold."""
    try:
        send(RUN_BATCH, batch_id)
    except OperationalError as exc:
        log.warning("batch %s not queued yet (the sweeper sends it again): %s", batch_id, exc)
