"""Celery tasks. Each one only translates: take ids, call one domain function, return plain data.

Tasks are declared on the project's one app under the names in ``base.celery``, which is where
senders find them (by name, with their queue).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from celery.signals import task_postrun
from django.conf import settings

from base.celery import (
    COMPOSE_MODEL, DELIVER_WEBHOOK, GRADE_SAMPLE, HOLD_TRAINING_RUN, RUN_BATCH, RUN_EVAL, SWEEP_JOBS, TAKE_TRAINING_TURN, WORKER_REPORT, app,
)

from core.freed_memory import give_back_freed_memory

if TYPE_CHECKING:
    from celery import Task

# At the soft limit the task is interrupted (SoftTimeLimitExceeded) and fails its job
# (``workers.run_job``); the hard limit, a minute later, kills a trainer too stuck even for that
# (the sweeper then finds the job's heartbeat stale: it queues the job again, and fails it after
# ``finetuning.job_status.MAX_ATTEMPTS``).
JOB_SOFT_LIMIT_S = settings.CONFIG.job_time_limit_s
JOB_HARD_LIMIT_S = JOB_SOFT_LIMIT_S + 60
# A composition takes tens of seconds (the most parents, at the served rank, on two cores); one
# still running after this is stuck, and fails (``workers.run_composition``). The sweeper fails one
# whose worker died (``finetuning.compositions.LOST_AFTER``, longer than the hard limit).
COMPOSITION_SOFT_LIMIT_S = 600
COMPOSITION_HARD_LIMIT_S = COMPOSITION_SOFT_LIMIT_S + 60
# An eval run answers at most ``evals.sources.MAX_ITEMS`` examples, a batch at a time: minutes on
# two cores. One still running after this fails, keeping the items it scored (``workers.run_eval``).
EVAL_RUN_SOFT_LIMIT_S = 3600
EVAL_RUN_HARD_LIMIT_S = EVAL_RUN_SOFT_LIMIT_S + 60


@task_postrun.connect
def _give_back_freed_memory(**_: object) -> None:
    """A task's memory is freed when it ends, and glibc would keep it for the worker's life: a trainer
    would hold gigabytes of a finished job's activations while it waits for the next."""
    give_back_freed_memory()


@app.task(name=WORKER_REPORT.name, queue=WORKER_REPORT.queue)
def worker_report() -> dict:
    """What this worker can reach: proves a task travelled the broker and the worker is usable."""
    from health.worker_report import report

    return report()


@app.task(
    name=TAKE_TRAINING_TURN.name, queue=TAKE_TRAINING_TURN.queue, bind=True, soft_time_limit=JOB_SOFT_LIMIT_S,
    time_limit=JOB_HARD_LIMIT_S,
)
def take_training_turn(self: Task, woken_by: str) -> str:
    """Train the job whose turn it is: the one whose message this is (``woken_by``), or another
    organization's (``finetuning.training_turns.claim_next``)."""
    from workers.run_job import run_job

    return run_job(woken_by, worker=self.request.hostname or "unknown")


@app.task(
    name=COMPOSE_MODEL.name, queue=COMPOSE_MODEL.queue, bind=True, soft_time_limit=COMPOSITION_SOFT_LIMIT_S,
    time_limit=COMPOSITION_HARD_LIMIT_S,
)
def compose_model(self: Task, composition_id: str) -> str:
    from workers.run_composition import run_composition

    return run_composition(composition_id, worker=self.request.hostname or "unknown")


@app.task(
    name=RUN_EVAL.name, queue=RUN_EVAL.queue, bind=True, soft_time_limit=EVAL_RUN_SOFT_LIMIT_S,
    time_limit=EVAL_RUN_HARD_LIMIT_S,
)
def run_eval(self: Task, run_id: str) -> str:
    from workers.run_eval import run_eval

    return run_eval(run_id, worker=self.request.hostname or "unknown")


GRADE_SOFT_LIMIT_S = 90  # its caller waits at most evals.grader_runs.RUN_WAIT_S


@app.task(name=GRADE_SAMPLE.name, queue=GRADE_SAMPLE.queue, soft_time_limit=GRADE_SOFT_LIMIT_S, time_limit=GRADE_SOFT_LIMIT_S + 10)
def grade_sample(reply_to: str, organization_id: str, payload: str) -> str:
    from workers.grade_sample import grade_sample

    return grade_sample(reply_to, int(organization_id), payload)


# A batch has 24 hours (its completion window) and stops itself at its end, at a line boundary;
# this only frees a worker stuck past it (the batch then fails, keeping its lines' results).
BATCH_SOFT_LIMIT_S = 25 * 3600
BATCH_HARD_LIMIT_S = BATCH_SOFT_LIMIT_S + 60


@app.task(
    name=RUN_BATCH.name, queue=RUN_BATCH.queue, bind=True, soft_time_limit=BATCH_SOFT_LIMIT_S,
    time_limit=BATCH_HARD_LIMIT_S,
)
def run_batch(self: Task, batch_id: str) -> str:
    from workers.run_batch import run_batch

    return run_batch(batch_id, worker=self.request.hostname or "unknown")


# A training run ends itself once idle (``LOOP_IDLE_SECONDS``); this only frees a trainer stuck past
# a working day of requests.
LOOP_SOFT_LIMIT_S = 12 * 3600
LOOP_HARD_LIMIT_S = LOOP_SOFT_LIMIT_S + 60


@app.task(
    name=HOLD_TRAINING_RUN.name, queue=HOLD_TRAINING_RUN.queue, bind=True, soft_time_limit=LOOP_SOFT_LIMIT_S,
    time_limit=LOOP_HARD_LIMIT_S,
)
def hold_training_run(self: Task, run_id: str) -> str:
    from workers.run_training_loop import run_training_loop

    return run_training_loop(run_id, worker=self.request.hostname or "unknown")


# An attempt ends within ``core.webhook_http.DEADLINE_S``; this only frees a worker stuck past it.
WEBHOOK_SOFT_LIMIT_S = 60
WEBHOOK_HARD_LIMIT_S = WEBHOOK_SOFT_LIMIT_S + 10


@app.task(
    name=DELIVER_WEBHOOK.name, queue=DELIVER_WEBHOOK.queue, soft_time_limit=WEBHOOK_SOFT_LIMIT_S,
    time_limit=WEBHOOK_HARD_LIMIT_S,
)
def deliver_webhook(delivery_id: str) -> str:
    """One attempt of a webhook delivery, if it is due; its retries are messages of their own."""
    from webhooks.delivery import deliver

    return deliver(delivery_id)


@app.task(name=SWEEP_JOBS.name, queue=SWEEP_JOBS.queue)
def sweep_jobs() -> dict:
    from workers.sweep import sweep

    return sweep()
