"""How a fine-tuning job's status moves once a trainer has claimed it, or a cancel or the sweeper
comes first.

Each move is a conditional update, so two processes that race (a worker and a cancel, two
deliveries of one task, a sweeper and a late heartbeat) cannot both win: running -> succeeded
(``succeed``) or failed (``fail``); unfinished -> cancelled (``cancel_job``); running with a stale
heartbeat -> queued again, or failed after MAX_ATTEMPTS (``recover_stale_jobs``). The move from
queued to running is a trainer's turn (``finetuning.training_turns.claim``). Each move to succeeded,
failed or cancelled emits its webhook event in the same transaction (``webhooks.emitting``).

``claim`` returns the attempt number, a fencing token: every later write of that run (heartbeat,
events, checkpoints, success, failure) is conditional on the job still running *that* attempt, so a
worker that was given up on but is still alive cannot overwrite what the next attempt does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from core.api_errors import ApiError
from finetuning import publishing
from finetuning.models import File, FineTuningJob, JobStatus, record_event
from webhooks.emitting import emit
from webhooks.event_types import EventType

MAX_ATTEMPTS = 3


def cancel_job(job: FineTuningJob) -> FineTuningJob:
    # Conditional, so a job that finished a moment ago is not turned into "cancelled".
    with transaction.atomic():
        updated = (
            FineTuningJob.objects.filter(pk=job.pk, status__in=(JobStatus.QUEUED, JobStatus.RUNNING))
            .update(status=JobStatus.CANCELLED, finished_at=timezone.now())
        )
        job.refresh_from_db()
        if updated:
            record_event(job, "Job cancelled by request")
            emit(job.organization_id, EventType.FINE_TUNING_JOB_CANCELLED, {"id": job.pk})
    if not updated:
        raise ApiError(f"Job {job.id} has already {job.status}; only unfinished jobs can be cancelled.", status=409, code="job_finished")
    return job


def _this_attempt(job_id: str, attempt: int) -> QuerySet[FineTuningJob]:
    return FineTuningJob.objects.filter(pk=job_id, status=JobStatus.RUNNING, attempts=attempt)


def heartbeat(job_id: str, attempt: int, **fields: object) -> bool:
    """Say the attempt's worker is alive; False when the job no longer runs this attempt (cancelled,
    or given up on and queued again): the attempt must stop, and write nothing more."""
    return bool(_this_attempt(job_id, attempt).update(heartbeat_at=timezone.now(), **fields))


def succeed(
    job: FineTuningJob,
    attempt: int,
    name: str,
    trained_tokens: int,
    final_loss: float | None,
    results: File | None = None,
    best_step: int | None = None,
) -> bool:
    """running -> succeeded, with its model in the registry and its ``results`` file (stored, not yet
    saved: ``finetuning.results``); ``best_step``: the step early stopping published. False when
    this attempt lost the job meanwhile (cancelled, or another attempt runs it)."""
    with transaction.atomic():
        succeeded = _this_attempt(job.pk, attempt).update(
            status=JobStatus.SUCCEEDED, fine_tuned_model=name, trained_tokens=trained_tokens,
            finished_at=timezone.now(), estimated_finish=None, result_file=results.id if results else None,
            best_step=best_step,
        )
        if succeeded:
            if results is not None:
                results.save()
            publishing.publish_trained_revision(job, name, final_loss)
            record_event(job, "The job has successfully completed")
            emit(job.organization_id, EventType.FINE_TUNING_JOB_SUCCEEDED, {"id": job.pk})
    return bool(succeeded)


def record_evaluation(job_id: str, attempt: int, scores: dict) -> None:
    """Keep the evaluation gate's scores on the job (only while this attempt runs it)."""
    job = _this_attempt(job_id, attempt).first()
    if job is not None and job.evaluation is not None:
        _this_attempt(job_id, attempt).update(evaluation=job.evaluation | {"scores": scores})


def fail(job_id: str, attempt: int, code: str, message: str) -> None:
    """running -> failed, with the reason the user reads (only while this attempt runs the job)."""
    with transaction.atomic():
        failed = _this_attempt(job_id, attempt).update(
            status=JobStatus.FAILED, error_code=code, error_message=message, finished_at=timezone.now(), estimated_finish=None
        )
        if failed:
            job = FineTuningJob.objects.get(pk=job_id)
            record_event(job, f"Job failed: {message}", level="error")
            emit(job.organization_id, EventType.FINE_TUNING_JOB_FAILED, {"id": job_id})


def status_of(job_id: str) -> str:
    return FineTuningJob.objects.filter(pk=job_id).values_list("status", flat=True).get()


def stale_after() -> timedelta:
    return timedelta(seconds=settings.CONFIG.job_stale_after_s)


@dataclass
class Recovered:
    requeued: list[str] = field(default_factory=list)  # for the caller to send to a trainer
    failed: list[str] = field(default_factory=list)  # worker_lost: no attempt will resume them


def recover_stale_jobs(stale_after: timedelta) -> Recovered:
    """Running jobs whose worker stopped sending heartbeats go back to queued, or fail after
    MAX_ATTEMPTS."""
    recovered = Recovered()
    now = timezone.now()
    for job in FineTuningJob.objects.filter(status=JobStatus.RUNNING, heartbeat_at__lt=now - stale_after):
        # Conditional on the heartbeat we saw: a worker that is alive after all keeps its job.
        still_stale = FineTuningJob.objects.filter(pk=job.pk, status=JobStatus.RUNNING, heartbeat_at=job.heartbeat_at)
        if job.attempts >= MAX_ATTEMPTS:
            message = f"The worker running this job stopped responding {job.attempts} times; giving up."
            with transaction.atomic():
                if still_stale.update(status=JobStatus.FAILED, error_code="worker_lost", error_message=message, finished_at=now):
                    record_event(job, f"Job failed: {message}", level="error")
                    emit(job.organization_id, EventType.FINE_TUNING_JOB_FAILED, {"id": job.pk})
                    recovered.failed.append(job.pk)
        elif still_stale.update(status=JobStatus.QUEUED, worker="", heartbeat_at=None, queued_at=now):
            record_event(job, f"Worker {job.worker} stopped responding; the job is queued again", level="warn")
            recovered.requeued.append(job.pk)
    return recovered
