"""Job events: what happened to a job, as the user reads it (messages and training metrics)."""

from __future__ import annotations

from finetuning.models import FineTuningJob, JobEvent


def record_event(job: FineTuningJob, message: str, *, level: str = "info", data: dict | None = None) -> JobEvent:
    return JobEvent.objects.create(job=job, message=message, level=level, type="metrics" if data else "message", data=data)
