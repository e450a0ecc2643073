"""The one Celery app of every process (Celery's Django layout), the tasks by name, and the broker.

A process holds exactly one Celery app. A second one (say, to ping workers) silently becomes what
``shared_task`` proxies resolve to on threads where this app is not current, and tasks then go to
the queue ``celery``, which nobody consumes. So this app is the default, tasks are declared on it,
senders name the task and its queue, and health checks ask workers through a plain connection.

It lives in ``base`` so that apps and workers import it without importing the project; the project
(``server/__init__.py``) loads it, so every process that loads Django has it.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass

import redis
from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "server.settings")

DEFAULT_QUEUE = "default"
TRAINING_QUEUE = "training"
# Batch API work (``workers.run_batch``): a process of its own (``batcher``), so hours of batch lines
# never hold the default queue's slots (eval runs, webhooks, the sweeper).
BATCH_QUEUE = "batch"
# Training runs driven step by step (the Tinker protocol, ``workers.run_training_loop``): a trainer
# holds one for as long as its client sends requests, so they never hold the jobs' trainers.
LOOPS_QUEUE = "loops"
REQUIRED_QUEUES = (DEFAULT_QUEUE, TRAINING_QUEUE)  # each needs a consumer for the platform to work

app = Celery("fineserve")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.set_default()


@dataclass(frozen=True)
class TaskName:
    name: str
    queue: str


# Wakes a trainer, which takes the job whose turn it is (``finetuning.training_turns``): not
# necessarily the job its message names.
TAKE_TRAINING_TURN = TaskName("workers.tasks.take_training_turn", TRAINING_QUEUE)
COMPOSE_MODEL = TaskName("workers.tasks.compose_model", DEFAULT_QUEUE)
RUN_EVAL = TaskName("workers.tasks.run_eval", DEFAULT_QUEUE)
GRADE_SAMPLE = TaskName("workers.tasks.grade_sample", DEFAULT_QUEUE)  # graders.run: its caller waits
RUN_BATCH = TaskName("workers.tasks.run_batch", BATCH_QUEUE)
HOLD_TRAINING_RUN = TaskName("workers.tasks.hold_training_run", LOOPS_QUEUE)
SWEEP_JOBS = TaskName("workers.tasks.sweep_jobs", DEFAULT_QUEUE)
DELIVER_WEBHOOK = TaskName("workers.tasks.deliver_webhook", DEFAULT_QUEUE)
WORKER_REPORT = TaskName("workers.tasks.worker_report", DEFAULT_QUEUE)


@app.on_after_configure.connect
def _schedule_sweeps(sender: Celery, **_: object) -> None:
    """The beat runs inside the `worker` process: every SWEEP_SECONDS it re-queues jobs whose worker
    died (stale heartbeat), sends again jobs whose message the broker lost, and tells queued jobs
    what they wait for. Read once the app is configured, when the settings are loaded."""
    from django.conf import settings

    sweep = sender.signature(SWEEP_JOBS.name, queue=SWEEP_JOBS.queue)
    sender.add_periodic_task(float(settings.CONFIG.sweep_s), sweep, name="sweep-jobs")


def send(task: TaskName, *args: str, countdown_s: float | None = None) -> None:
    """Publish a task by name to its queue (to run ``countdown_s`` from now, if given); raises
    ``kombu.exceptions.OperationalError`` when the broker cannot take it (after the app's short
    publish retry policy). Nobody waits for the result, so the sender does not subscribe to it
    (which would need the result store up as well)."""
    app.send_task(task.name, args=args, queue=task.queue, ignore_result=True, countdown=countdown_s)


def queue_consumers(broker_url: str, timeout_s: float, expect_workers: int | None = None) -> dict[str, list[str]]:
    """Which workers consume each queue, as they answer the ``active_queues`` control broadcast.

    A broadcast cannot know how many workers will answer, so it waits ``timeout_s``; with
    ``expect_workers`` it returns as soon as that many have answered. It goes through a plain
    connection to ``broker_url`` and a mailbox of its own (the app's control API would publish
    through the app's producer pool, to the app's broker whatever ``broker_url`` says), so a
    broker that is down fails here at once and leaves nothing behind in the app's pools."""
    mailbox = app.control.Mailbox(
        app.conf.control_exchange, type="fanout", accept=app.conf.accept_content, serializer=app.conf.task_serializer
    )
    with app.connection_for_read(broker_url) as connection:
        connection.ensure_connection(max_retries=1)
        replies = mailbox(connection)._broadcast("active_queues", reply=True, timeout=timeout_s, limit=expect_workers)
    consumers: dict[str, list[str]] = {}
    for reply in replies or []:
        for worker, queues in reply.items():
            for queue in queues:
                consumers.setdefault(queue["name"], []).append(worker)
    return {queue: sorted(workers) for queue, workers in consumers.items()}


def waiting_task_args(broker_url: str, task: TaskName) -> set[str]:
    """The first argument of every ``task`` message the broker holds: waiting in its queue, or
    delivered to a worker and not yet acknowledged.

    Celery has no API for this, so it reads kombu's Redis layout (a list per queue, and the hash
    ``unacked`` of delivered messages). It serves the sweeper that finds jobs whose message was
    lost; a message it cannot parse is passed over, and at worst a job is sent twice, which the
    conditional claim makes harmless."""
    client = redis.Redis.from_url(broker_url, socket_timeout=5)
    try:
        waiting, unacked = client.lrange(task.queue, 0, -1), client.hvals("unacked")
    finally:
        client.close()
    found = set()
    for raw, delivered in [*((m, False) for m in waiting), *((m, True) for m in unacked)]:
        try:
            envelope = json.loads(raw)
            if delivered:  # kombu keeps [message, exchange, routing key] for a delivered one
                envelope = envelope[0]
            if envelope["headers"]["task"] == task.name:
                args, _kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
                found.add(args[0])
        except (ValueError, KeyError, IndexError, TypeError):
            continue
    return found
