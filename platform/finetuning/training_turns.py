"""Whose turn it is to train: organizations take turns at the trainers (fair share), and a trainer
claims the job whose turn it is.

A broker message only wakes a trainer; ``claim_next`` then claims the oldest queued job of the
organization whose turn it is (``turn_order``: fewest jobs running, then the one that started a job
least recently), which need not be the job the message names. That job, still queued, is sent
again, so every queued job keeps a message and the sweeper's accounting holds. So one
organization's 50 jobs, queued first, do not make another's one wait for all of them, even with a
single trainer. An organization also trains at most RUNNING_JOBS_PER_ORGANIZATION jobs at once:
``claim`` counts its running jobs under its lock (``accounts.locks``, so two trainers cannot both
take its last slot) and refuses a job over the cap. A job refused for the cap stays queued, with no
message, until a slot frees: the trainer that finishes one of the organization's jobs sends its
oldest waiting jobs (``send_waiting``), and the sweeper sends any the hand-off missed (a trainer
that died) once the organization has a free slot.

``claim`` is the one move from queued to running, a conditional update (only one trainer wins a
job); it returns the attempt number, the fencing token of every later write of that run
(``finetuning.job_status``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timezone as dt_timezone

from django.conf import settings
from django.db import transaction
from django.db.models import Count, F, Max, Min
from django.utils import timezone
from kombu.exceptions import OperationalError

from accounts.locks import lock_organization
from core.config import LIMIT_SETTINGS
from finetuning.models import FineTuningJob, JobStatus, record_event
from base.celery import TAKE_TRAINING_TURN, TRAINING_QUEUE, send

log = logging.getLogger(__name__)


def send_to_trainer(job_id: str) -> None:
    """Wake a trainer for a queued job. Sending twice is harmless: only one ``claim`` wins."""
    send(TAKE_TRAINING_TURN, job_id)


_NEVER = datetime.min.replace(tzinfo=dt_timezone.utc)


@dataclass(frozen=True)
class Turn:
    organization_id: int
    running: int  # its jobs running now
    queued: int  # its jobs waiting


def turn_order() -> list[Turn]:
    """Organizations with queued jobs, in the order they get the next free trainer: fewest jobs
    running first, then the one whose last job started longest ago (one that never started a job
    first), then the one whose oldest job has waited longest."""
    queued = FineTuningJob.objects.filter(status=JobStatus.QUEUED).values("organization_id")
    waiting = {row["organization_id"]: row for row in queued.annotate(count=Count("pk"), oldest=Min("queued_at"))}
    if not waiting:
        return []
    of_them = FineTuningJob.objects.filter(organization_id__in=waiting).values("organization_id")
    running = dict(of_them.filter(status=JobStatus.RUNNING).annotate(n=Count("pk")).values_list("organization_id", "n"))
    last_start = dict(of_them.filter(started_at__isnull=False).annotate(last=Max("started_at")).values_list("organization_id", "last"))
    order = sorted(waiting, key=lambda org: (running.get(org, 0), last_start.get(org) or _NEVER, waiting[org]["oldest"] or _NEVER))
    return [Turn(org, running.get(org, 0), waiting[org]["count"]) for org in order]


def _jobs_ahead(job: FineTuningJob) -> int:
    """About how many jobs a trainer takes before this queued one: those running, then, turn by
    turn (``turn_order``), its organization's earlier jobs and as many of every other
    organization's (ignoring the running-job caps)."""
    running = FineTuningJob.objects.filter(status=JobStatus.RUNNING).count()
    own_earlier = FineTuningJob.objects.filter(
        organization_id=job.organization_id, status=JobStatus.QUEUED, queued_at__lt=job.queued_at
    ).count()
    turns = turn_order()
    mine = next((i for i, turn in enumerate(turns) if turn.organization_id == job.organization_id), len(turns))
    others = sum(
        min(turn.queued, own_earlier + (1 if i < mine else 0))
        for i, turn in enumerate(turns) if turn.organization_id != job.organization_id
    )
    return running + own_earlier + others


def jobs_ahead_phrase(job: FineTuningJob) -> str:
    ahead = _jobs_ahead(job)
    return "no job ahead" if ahead == 0 else f"{ahead} job{'s' if ahead > 1 else ''} ahead"


def _running_count(organization_id: int) -> int:
    return FineTuningJob.objects.filter(organization_id=organization_id, status=JobStatus.RUNNING).count()


def _cap_note(running: int) -> str:
    return (
        f"Waiting: the organization already runs {running} job{'s' if running > 1 else ''}, its limit "
        f"({LIMIT_SETTINGS['running_jobs_per_organization']}); the job starts when one of them finishes"
    )


def waiting_note(job: FineTuningJob, trainers: int) -> str:
    """What a queued job waits for, as its events say it."""
    running = _running_count(job.organization_id)
    if running >= settings.CONFIG.limits.running_jobs_per_organization:
        return _cap_note(running)
    if trainers == 0:
        return f"No trainer is connected to the '{TRAINING_QUEUE}' queue; the job starts when one connects"
    return f"Waiting for a trainer: {jobs_ahead_phrase(job)}"


def claim(job_id: str, worker: str) -> int | None:
    """queued -> running, for exactly one worker: its attempt number, or None when another worker
    has the job, it is no longer queued, or its organization already runs its cap of jobs (then it
    stays queued, and says so, until ``send_waiting`` or the sweeper sends it again)."""
    organization_id = FineTuningJob.objects.filter(pk=job_id).values_list("organization_id", flat=True).first()
    if organization_id is None:
        return None
    with transaction.atomic():
        lock_organization(organization_id)  # until the commit: the count below stays true
        running = _running_count(organization_id)
        if running >= settings.CONFIG.limits.running_jobs_per_organization:
            claimed = 0
        else:
            now = timezone.now()
            claimed = FineTuningJob.objects.filter(pk=job_id, status=JobStatus.QUEUED).update(
                status=JobStatus.RUNNING, worker=worker, started_at=now, heartbeat_at=now, attempts=F("attempts") + 1
            )
    if not claimed:
        _note_waiting_for_a_slot(job_id, running)
        return None
    return FineTuningJob.objects.filter(pk=job_id).values_list("attempts", flat=True).get()


def _note_waiting_for_a_slot(job_id: str, running: int) -> None:
    job = FineTuningJob.objects.filter(pk=job_id, status=JobStatus.QUEUED).first()
    if job is None or running < settings.CONFIG.limits.running_jobs_per_organization:
        return  # claimed by another worker, or no longer queued: nothing to say
    note = _cap_note(running)
    if job.events.filter(type="message").values_list("message", flat=True).first() != note:
        record_event(job, note)  # once, however many times it is refused


@dataclass(frozen=True)
class Claim:
    job_id: str
    attempt: int


def claim_next(woken_by: str, worker: str) -> Claim | None:
    """For a trainer woken by job ``woken_by``'s message: claim the oldest queued job of the
    organization whose turn it is (fair share; not necessarily ``woken_by``), and send
    ``woken_by`` again when it was passed over, so it keeps a message. None when ``woken_by`` is
    no longer queued (its message is spent) or no organization with a waiting job has a free slot."""
    woken_organization = (
        FineTuningJob.objects.filter(pk=woken_by, status=JobStatus.QUEUED).values_list("organization_id", flat=True).first()
    )
    if woken_organization is None:
        return None
    cap = settings.CONFIG.limits.running_jobs_per_organization
    for turn in turn_order():
        if turn.running >= cap:
            continue
        job_id = (
            FineTuningJob.objects.filter(organization_id=turn.organization_id, status=JobStatus.QUEUED)
            .order_by("queued_at").values_list("pk", flat=True).first()
        )
        attempt = claim(job_id, worker) if job_id else None
        if job_id and attempt is not None:
            if job_id != woken_by:
                _send_again(woken_by)
            return Claim(job_id, attempt)
    _note_waiting_for_a_slot(woken_by, _running_count(woken_organization))
    return None


def _send_again(job_id: str) -> bool:
    """Send a queued job to the trainers again; a send that fails (the broker went away) leaves it
    to the sweeper, which sends a job whose message it finds missing."""
    try:
        send_to_trainer(job_id)
    except OperationalError as exc:
        log.warning("could not send job %s to a trainer: %s", job_id, exc)
        return False
    return True


def free_slots(organization_id: int) -> int:
    """How many more of the organization's jobs may run now."""
    return max(0, settings.CONFIG.limits.running_jobs_per_organization - _running_count(organization_id))


def send_waiting(organization_id: int) -> list[str]:
    """Send the organization's oldest queued jobs, as many as it has free slots: for a trainer that
    has just finished one of its jobs. A job whose message is still in the broker is sent twice,
    which is harmless (one ``claim`` wins)."""
    waiting = FineTuningJob.objects.filter(organization_id=organization_id, status=JobStatus.QUEUED)
    oldest = waiting.order_by("queued_at").values_list("pk", flat=True)[: free_slots(organization_id)]
    return [job_id for job_id in oldest if _send_again(job_id)]


def mark_sent_again(job: FineTuningJob) -> bool:
    """For a queued job whose message the broker lost: restart its wait, conditionally (it may
    have been claimed a moment ago). True when the caller should send it."""
    resent = FineTuningJob.objects.filter(pk=job.pk, status=JobStatus.QUEUED, queued_at=job.queued_at).update(queued_at=timezone.now())
    if resent:
        record_event(job, "The job's message to the trainers was lost (a broker restart?); it is sent again", level="warn")
    return bool(resent)
