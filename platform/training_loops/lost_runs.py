"""Training runs whose trainer died (its beat silent past JOB_STALE_AFTER_SECONDS) fail, naming the
last state they saved, and every request still queued for them fails with that reason: a client
waiting on a future gets the error, not "try again" for ever. The sweeper calls this."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

from django.conf import settings

from training_loops import futures
from training_loops.models import CheckpointKind, LoopRun, RunStatus


def fail_lost_runs(now: datetime) -> list[str]:
    """The ids of the runs failed now."""
    stale = now - timedelta(seconds=settings.CONFIG.job_stale_after_s)
    failed = []
    for run in LoopRun.objects.filter(status=RunStatus.RUNNING, heartbeat_at__lt=stale):
        last = run.checkpoints.filter(kind=CheckpointKind.STATE).first()
        go_on = f"go on from its last saved state, {last.path}" if last else "it saved no state: start a new run"
        message = f"its trainer stopped answering (the worker died or was restarted); {go_on}"
        if LoopRun.objects.filter(pk=run.pk, status=RunStatus.RUNNING, heartbeat_at__lt=stale).update(
            status=RunStatus.FAILED, error_message=message
        ):
            _fail_queued(run.pk, f"Training run {run.pk} failed: {message}")
            failed.append(run.pk)
    return failed


def _fail_queued(run_id: str, message: str) -> None:
    client = futures.sync_redis()
    while (queued := client.lpop(futures.ops_key(run_id))) is not None:
        assert isinstance(queued, bytes)  # one item popped
        futures.finish(client, json.loads(queued)["request_id"], futures.failure(message, by_user=False))
