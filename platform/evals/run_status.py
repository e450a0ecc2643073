"""A run's status moves only here, each time with a conditional update, so two deliveries of one
task cannot both score it and a cancel is seen by the worker at its next batch:
queued -> in_progress (``claim``) -> completed (``complete``), failed (``fail``) or canceled (``cancel``,
also from queued). Between, ``record`` adds a batch's scored items and the running totals, only
while the run is still in progress. Each move to a finished status emits its webhook event in the
same transaction (``webhooks.emitting``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from django.db import transaction
from django.utils import timezone

from core.evaluation import mean_score
from evals.models import UNFINISHED_RUN_STATUSES, EvalRun, OutputItem, RunStatus
from webhooks.emitting import emit
from webhooks.event_types import EventType


@dataclass
class Totals:
    """A run's counts so far, as the worker keeps them (it alone writes them while it runs)."""

    done: int = 0
    passed: int = 0
    failed: int = 0
    errored: int = 0
    per_criteria: dict[str, dict[str, float]] = field(default_factory=dict)  # passed, failed, score_sum
    usage: dict[str, int] = field(default_factory=dict)
    scores: list[list[float]] = field(default_factory=list)  # each answered item's, per grader

    @property
    def score(self) -> float | None:
        """The mean over the answered items of their graders' mean score (``core.evaluation.mean_score``)."""
        return mean_score(self.scores) if self.scores else None

    def add(self, item: OutputItem) -> None:
        self.done += 1
        if item.status == "error":
            self.errored += 1
        else:
            self.passed += item.status == "pass"
            self.failed += item.status == "fail"
            self.scores.append([result["score"] for result in item.results])
            for result in item.results:
                counts = self.per_criteria.setdefault(result["name"], {"passed": 0, "failed": 0, "score_sum": 0.0})
                counts["passed" if result["passed"] else "failed"] += 1
                counts["score_sum"] = counts.get("score_sum", 0.0) + result["score"]
        if item.answer is not None or item.usage:
            self.usage["invocation_count"] = self.usage.get("invocation_count", 0) + 1
        for key, value in item.usage.items():
            self.usage[key] = self.usage.get(key, 0) + value


def claim(run_id: str, worker: str) -> EvalRun | None:
    """queued -> in_progress, for exactly one worker; None when it runs elsewhere or has finished."""
    queued = EvalRun.objects.filter(pk=run_id, status=RunStatus.QUEUED)
    if not queued.update(status=RunStatus.IN_PROGRESS, worker=worker, started_at=timezone.now()):
        return None
    return EvalRun.objects.select_related("eval", "organization").get(pk=run_id)


def record(run_id: str, items: list[OutputItem], totals: Totals) -> bool:
    """Keep a batch's items and the totals with them; False when the run is no longer in progress
    (canceled, or deleted): the worker stops, and the batch is not kept."""
    with transaction.atomic():
        updated = EvalRun.objects.filter(pk=run_id, status=RunStatus.IN_PROGRESS).update(
            done_items=totals.done, passed_items=totals.passed, failed_items=totals.failed,
            errored_items=totals.errored, per_criteria=totals.per_criteria, usage=totals.usage, score=totals.score,
        )
        if not updated:
            return False
        OutputItem.objects.bulk_create(items)
    return True


def complete(run_id: str, total_items: int) -> bool:
    running = EvalRun.objects.filter(pk=run_id, status=RunStatus.IN_PROGRESS)
    with transaction.atomic():
        completed = running.update(status=RunStatus.COMPLETED, total_items=total_items, finished_at=timezone.now())
        if completed:
            _emit(run_id, EventType.EVAL_RUN_SUCCEEDED)
    return bool(completed)


def _emit(run_id: str, event_type: EventType) -> None:
    """The webhook event of a run that has just finished, in the transaction that finished it."""
    organization_id = EvalRun.objects.filter(pk=run_id).values_list("organization_id", flat=True).get()
    emit(organization_id, event_type, {"id": run_id})


def set_total(run_id: str, total_items: int) -> None:
    """The examples the worker found (the file is read again when the run starts)."""
    EvalRun.objects.filter(pk=run_id, status=RunStatus.IN_PROGRESS).update(total_items=total_items)


def fail(run_id: str, code: str, message: str) -> bool:
    """queued or in progress -> failed, with the reason the user reads."""
    unfinished = EvalRun.objects.filter(pk=run_id, status__in=UNFINISHED_RUN_STATUSES)
    with transaction.atomic():
        failed = unfinished.update(status=RunStatus.FAILED, error_code=code, error_message=message, finished_at=timezone.now())
        if failed:
            _emit(run_id, EventType.EVAL_RUN_FAILED)
    return bool(failed)


def cancel(run: EvalRun) -> EvalRun:
    """queued or in progress -> canceled (a finished run stays as it is); the worker stops at its
    next batch, and the items it scored so far stay."""
    with transaction.atomic():
        canceled = EvalRun.objects.filter(pk=run.pk, status__in=UNFINISHED_RUN_STATUSES).update(
            status=RunStatus.CANCELED, finished_at=timezone.now()
        )
        if canceled:
            _emit(run.pk, EventType.EVAL_RUN_CANCELED)
    run.refresh_from_db()
    return run
