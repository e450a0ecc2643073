"""Celery tasks. Each one only translates: take ids, call one domain function, return plain data."""

from __future__ import annotations

from celery import shared_task


@shared_task
def worker_report() -> dict:
    """What this worker can reach: proves a task travelled the broker and the worker is usable."""
    from health.worker_report import report

    return report()


@shared_task(bind=True)
def train_job(self, job_id: str) -> str:
    from finetuning.runner import run_job

    return run_job(job_id, worker=self.request.hostname or "unknown")


@shared_task
def recover_jobs() -> list[str]:
    from finetuning.runner import recover_stale_jobs

    return recover_stale_jobs()
