"""Celery tasks. Each one only translates: take ids, call one domain function, return plain data."""

from __future__ import annotations

from celery import shared_task


@shared_task
def worker_report() -> dict:
    """What this worker can reach: proves a task travelled the broker and the worker is usable."""
    from health.worker_report import report

    return report()
