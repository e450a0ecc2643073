"""A batch's status moves only here, each time with a conditional update, so two deliveries of one
task cannot both answer it and a cancel is seen by the worker at its next line boundary:

validating -> in_progress (``claim``) -> finalizing (``finalize``) -> completed (``finish``);
in_progress -> cancelling (``cancel``) -> cancelled (``finish``, with the lines answered so far);
validating -> cancelled (``cancel``: nothing had started); past its window -> expired (``finish``, or
``expire_waiting`` for one no worker took); anything unfinished -> failed (``fail``).

Each claim is a new ``attempt``; ``record`` and every later move are conditional on it, so a worker
the sweeper gave up on (its heartbeat stopped) and whose batch was sent again writes nothing more.
Each move to a finished status emits its webhook event in the same transaction."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Count, Q, QuerySet, Sum
from django.utils import timezone

from batches.models import UNFINISHED_BATCH_STATUSES, WORKING_STATUSES, Batch, BatchResult, BatchStatus
from webhooks.emitting import emit
from webhooks.event_types import EventType

FINISHED_EVENTS = {
    BatchStatus.COMPLETED: EventType.BATCH_COMPLETED,
    BatchStatus.FAILED: EventType.BATCH_FAILED,
    BatchStatus.EXPIRED: EventType.BATCH_EXPIRED,
    BatchStatus.CANCELLED: EventType.BATCH_CANCELLED,
}
_STAMPS = {
    BatchStatus.COMPLETED: "completed_at", BatchStatus.FAILED: "failed_at", BatchStatus.EXPIRED: "expired_at",
    BatchStatus.CANCELLED: "cancelled_at",
}


# A worker writes its heartbeat with each group of lines it answers (``record``): one silent for this
# long has died, and its batch may be claimed again. A group is a few answers: seconds to minutes.
STALE_AFTER = timedelta(minutes=10)


@dataclass(frozen=True)
class Claim:
    batch: Batch
    attempt: int


def claim(batch_id: str, worker: str, stale_after: timedelta = STALE_AFTER) -> Claim | None:
    """The batch for this worker: a waiting one (validating -> in_progress), or one whose worker
    stopped sending heartbeats (a re-delivered task: it goes on from the lines answered). None when
    another worker holds it, or it has finished."""
    now = timezone.now()
    batch = Batch.objects.filter(pk=batch_id).first()
    if batch is None or batch.is_finished:
        return None
    mine = Batch.objects.filter(pk=batch_id, attempt=batch.attempt)
    if batch.status == BatchStatus.VALIDATING:
        taken = mine.filter(status=BatchStatus.VALIDATING).update(
            status=BatchStatus.IN_PROGRESS,
            in_progress_at=now,
            attempt=batch.attempt + 1,
            worker=worker,
            heartbeat_at=now,
        )
    else:  # under way: only once its worker is silent (a heartbeat missing, or never sent)
        silent = Q(heartbeat_at__isnull=True) | Q(heartbeat_at__lt=now - stale_after)
        taken = mine.filter(silent, status__in=WORKING_STATUSES).update(
            attempt=batch.attempt + 1, worker=worker, heartbeat_at=now
        )
    if not taken:
        return None
    return Claim(Batch.objects.select_related("organization").get(pk=batch_id), batch.attempt + 1)


def _held(claimed: Claim, *statuses: str) -> QuerySet[Batch]:
    return Batch.objects.filter(pk=claimed.batch.pk, attempt=claimed.attempt, status__in=statuses)


def set_total(claimed: Claim, total: int) -> None:
    _held(claimed, *WORKING_STATUSES).update(total=total)


def answered_lines(batch_id: str) -> set[int]:
    """The lines that have their result already: a re-delivered task skips them."""
    return set(BatchResult.objects.filter(batch_id=batch_id).values_list("line", flat=True))


def record(claimed: Claim, results: list[BatchResult]) -> str | None:
    """Keep a group of lines' results and the counts with them, as the worker's heartbeat; the
    batch's status afterwards (in_progress, or cancelling: the worker stops), None when this worker
    no longer holds it (fenced off, deleted)."""
    with transaction.atomic():
        held = (
            Batch.objects.select_for_update()
            .filter(
                pk=claimed.batch.pk,
                attempt=claimed.attempt,
                status__in=(BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING),
            )
            .first()
        )
        if held is None:
            return None
        BatchResult.objects.bulk_create(results)
        counts = BatchResult.objects.filter(batch_id=held.pk).aggregate(
            completed=Count("pk", filter=Q(ok=True)), failed=Count("pk", filter=Q(ok=False)),
            input_tokens=Sum("input_tokens"), output_tokens=Sum("output_tokens"), cached_tokens=Sum("cached_tokens"),
        )
        usage = {name: counts[name] or 0 for name in ("input_tokens", "output_tokens", "cached_tokens")}
        Batch.objects.filter(pk=held.pk).update(
            completed=counts["completed"], failed=counts["failed"], usage=usage, heartbeat_at=timezone.now()
        )
    return held.status


def beat(claimed: Claim) -> None:
    """The worker is alive (between groups, while a slow line runs)."""
    _held(claimed, *WORKING_STATUSES).update(heartbeat_at=timezone.now())


def finalize(claimed: Claim) -> bool:
    """in_progress -> finalizing, once every line has its result: the files are written next."""
    held = _held(claimed, BatchStatus.IN_PROGRESS)
    return bool(held.update(status=BatchStatus.FINALIZING, finalizing_at=timezone.now()))


def ending(claimed: Claim, now: datetime) -> BatchStatus | None:
    """The finished status the batch goes to now, if any: cancelled (cancelling), expired (past its
    window), completed (finalizing); None while it has lines to answer."""
    batch = Batch.objects.filter(pk=claimed.batch.pk, attempt=claimed.attempt).first()
    if batch is None or batch.is_finished:
        return None
    if batch.status == BatchStatus.CANCELLING:
        return BatchStatus.CANCELLED
    if batch.status == BatchStatus.FINALIZING:  # every line answered: in time, whatever the clock says now
        return BatchStatus.COMPLETED
    if now >= batch.expires_at:
        return BatchStatus.EXPIRED
    return None


def finish(claimed: Claim, status: BatchStatus, output_file_id: str | None, error_file_id: str | None) -> bool:
    """Working -> completed, cancelled or expired, with the files of the lines answered."""
    now = timezone.now()
    with transaction.atomic():
        moved = _held(claimed, *WORKING_STATUSES).update(
            status=status, output_file_id=output_file_id, error_file_id=error_file_id, **{_STAMPS[status]: now}
        )
        if moved:
            emit(claimed.batch.organization_id, FINISHED_EVENTS[status], {"id": claimed.batch.pk})
    return bool(moved)


def fail(batch_id: str, code: str, message: str, line: int | None = None) -> bool:
    """Any unfinished status -> failed, with the reason the user reads (OpenAI's ``errors`` list)."""
    error = {"code": code, "message": message, "param": None, "line": line}
    with transaction.atomic():
        failed = Batch.objects.filter(pk=batch_id, status__in=UNFINISHED_BATCH_STATUSES).update(
            status=BatchStatus.FAILED, errors=[error], failed_at=timezone.now()
        )
        if failed:
            organization_id = Batch.objects.filter(pk=batch_id).values_list("organization_id", flat=True).get()
            emit(organization_id, EventType.BATCH_FAILED, {"id": batch_id})
    return bool(failed)


def cancel(batch: Batch) -> Batch:
    """validating -> cancelled at once (nothing started); in progress -> cancelling (its worker stops
    at its next line boundary and writes the files of the lines answered). Otherwise as it is."""
    now = timezone.now()
    with transaction.atomic():
        if Batch.objects.filter(pk=batch.pk, status=BatchStatus.VALIDATING).update(
            status=BatchStatus.CANCELLED, cancelling_at=now, cancelled_at=now
        ):
            emit(batch.organization_id, EventType.BATCH_CANCELLED, {"id": batch.pk})
        else:
            Batch.objects.filter(pk=batch.pk, status=BatchStatus.IN_PROGRESS).update(
                status=BatchStatus.CANCELLING, cancelling_at=now
            )
    batch.refresh_from_db()
    return batch


def stale(stale_after: timedelta = STALE_AFTER) -> list[str]:
    """Batches under way whose worker went silent: the sweeper sends them again."""
    silent = Q(heartbeat_at__isnull=True) | Q(heartbeat_at__lt=timezone.now() - stale_after)
    return list(Batch.objects.filter(silent, status__in=WORKING_STATUSES).values_list("pk", flat=True))


def waiting(created_before: datetime) -> list[str]:
    """Batches waiting for a worker since before ``created_before``: their message may be lost."""
    return list(
        Batch.objects.filter(status=BatchStatus.VALIDATING, created_at__lt=created_before).values_list("pk", flat=True)
    )


def expire_waiting(now: datetime) -> list[str]:
    """Batches no worker took within their window: expired, with no lines answered (the sweeper)."""
    expired = []
    for batch_id, organization_id in Batch.objects.filter(
        status=BatchStatus.VALIDATING, expires_at__lte=now
    ).values_list("pk", "organization_id"):
        with transaction.atomic():
            if Batch.objects.filter(pk=batch_id, status=BatchStatus.VALIDATING).update(
                status=BatchStatus.EXPIRED, expired_at=now
            ):
                emit(organization_id, EventType.BATCH_EXPIRED, {"id": batch_id})
                expired.append(batch_id)
    return expired
