"""The sweeper (a Celery beat task in the ``worker`` process): no job waits silently.

The database says which jobs wait; a broker message only wakes a trainer for one. So every pass:
- running jobs whose worker stopped sending heartbeats are queued again (or failed) and sent;
- queued jobs whose message the broker no longer holds (a broker restart without persistence, an
  enqueue that failed while it was down, a job refused for its organization's running-job cap whose
  hand-off never came) are sent again, oldest first and no more per organization than it has free
  slots (``finetuning.training_turns``: fair share); a duplicate is harmless, as only one ``claim`` wins;
- each queued job's events say what it waits for, when that changes.
- the checkpoints of jobs that ended without publishing go once their retention is over
  (``finetuning.registry.expire_unpublished_checkpoints``);
- compositions (``finetuning.compositions``) running for longer than any worker may are failed
  (their worker died), and queued ones whose message the broker no longer holds are sent again;
- batches waiting for a worker whose message the broker no longer holds, and batches under way whose
  worker stopped sending heartbeats, are sent again (a claim goes on from the lines answered:
  ``workers.run_batch``); batches no worker took within their window expire;
- webhook deliveries overdue (their message lost) or stuck in an attempt whose worker died are sent
  again (``webhooks.delivery.resend_lost``).
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.utils import timezone
from kombu.exceptions import OperationalError

from batches import batch_status
from batches.creation import send_to_worker as send_batch
from finetuning import compositions, job_status, registry, training_turns
from finetuning.models import Composition, CompositionStatus, FineTuningJob, JobStatus, record_event
from base.celery import COMPOSE_MODEL, RUN_BATCH, TAKE_TRAINING_TURN, TRAINING_QUEUE, queue_consumers, waiting_task_args
from training_loops.lost_runs import fail_lost_runs
from webhooks import delivery
from workers.run_job import drop_training_states

log = logging.getLogger(__name__)

_INSPECT_TIMEOUT_S = 1.0


def sweep(stale_after: timedelta | None = None, lost_after: timedelta | None = None) -> dict:
    """``lost_after``: a message this old that the broker does not hold is lost (LOST_MESSAGE_SECONDS)."""
    if lost_after is None:  # not `or`: timedelta(0), "every overdue message is lost", is falsy
        lost_after = timedelta(seconds=settings.CONFIG.lost_message_s)
    recovered = job_status.recover_stale_jobs(stale_after or job_status.stale_after())
    for job_id in recovered.failed:
        drop_training_states(job_id)
    resent = _resend_lost(lost_after)
    for job_id in recovered.requeued + resent:
        _send(job_id)
    trainers = len(queue_consumers(settings.CELERY_BROKER_URL, _INSPECT_TIMEOUT_S).get(TRAINING_QUEUE, []))
    for job in FineTuningJob.objects.filter(status=JobStatus.QUEUED):
        note = training_turns.waiting_note(job, trainers)
        if job.events.filter(type="message").values_list("message", flat=True).first() != note:
            record_event(job, note)  # only when what it waits for has changed
    expired = registry.expire_unpublished_checkpoints(timezone.now())
    lost_compositions = compositions.fail_lost()
    resent_compositions = _resend_lost_compositions(lost_after)
    resent_deliveries = delivery.resend_lost(lost_after)
    expired_batches = batch_status.expire_waiting(timezone.now())
    resent_batches = _resend_batches(lost_after)
    lost_runs = fail_lost_runs(timezone.now())
    return {
        "requeued": recovered.requeued,
        "failed": recovered.failed,
        "resent": resent,
        "trainers": trainers,
        "checkpoints_expired": expired,
        "compositions_failed": lost_compositions,
        "compositions_resent": resent_compositions,
        "webhook_deliveries_resent": resent_deliveries,
        "batches_expired": expired_batches,
        "batches_resent": resent_batches,
        "training_runs_failed": lost_runs,
    }


def _resend_lost(lost_after: timedelta) -> list[str]:
    overdue = FineTuningJob.objects.filter(status=JobStatus.QUEUED, queued_at__lt=timezone.now() - lost_after)
    if not overdue.exists():
        return []  # the common case: no need to read the broker's queue
    held = waiting_task_args(settings.CELERY_BROKER_URL, TAKE_TRAINING_TURN)
    free: dict[int, int] = {}  # per organization, the slots not yet given to a job sent in this pass
    resent = []
    for job in overdue.order_by("queued_at"):
        if job.pk in held:
            continue
        if job.organization_id not in free:
            free[job.organization_id] = training_turns.free_slots(job.organization_id)
        if free[job.organization_id] > 0 and training_turns.mark_sent_again(job):
            free[job.organization_id] -= 1
            resent.append(job.pk)
    return resent


def _resend_lost_compositions(lost_after: timedelta) -> list[str]:
    overdue = Composition.objects.filter(status=CompositionStatus.QUEUED, created_at__lt=timezone.now() - lost_after)
    if not overdue.exists():
        return []
    held = waiting_task_args(settings.CELERY_BROKER_URL, COMPOSE_MODEL)
    resent = []
    for composition_id in overdue.values_list("pk", flat=True):
        if composition_id in held:
            continue
        try:
            compositions.send_to_worker(composition_id)  # twice is harmless: one claim wins
        except OperationalError as exc:
            log.warning("could not send composition %s to a worker: %s", composition_id, exc)
            break
        resent.append(composition_id)
    return resent


def _resend_batches(lost_after: timedelta) -> list[str]:
    """Waiting batches whose message is lost, and batches whose worker went silent (their message,
    if the broker still holds it, is a dead worker's: a second one is harmless, one claim wins)."""
    lost = batch_status.waiting(timezone.now() - lost_after)
    silent = batch_status.stale()
    if not lost and not silent:
        return []  # the common case: no need to read the broker's queue
    held = waiting_task_args(settings.CELERY_BROKER_URL, RUN_BATCH) if lost else set()
    resent = [batch_id for batch_id in lost if batch_id not in held] + silent
    for batch_id in resent:
        send_batch(batch_id)  # a broker that is down: logged, and the next pass tries again
    return resent


def _send(job_id: str) -> None:
    try:
        training_turns.send_to_trainer(job_id)
    except OperationalError as exc:  # the broker went away again: the next pass finds the job
        log.warning("could not send job %s to a trainer: %s", job_id, exc)

