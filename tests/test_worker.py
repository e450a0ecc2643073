import threading

import pytest
from celery import current_app
from celery.signals import before_task_publish
from django.db import connection

from base.celery import TAKE_TRAINING_TURN, WORKER_REPORT, app, send
from workers.tasks import worker_report


@pytest.mark.django_db(transaction=True)
def test_a_task_travels_the_real_broker_to_a_worker_process_that_reaches_the_database(celery_worker):
    report = worker_report.delay().get(timeout=60)
    assert report["database"] == {"ok": True, "detail": connection.vendor}
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in report["models_with_weights"]


def test_tasks_travel_as_json_only():
    assert app.conf.task_serializer == "json" and app.conf.accept_content == ["json"]


def in_new_thread(function):
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", function()))
    thread.start()
    thread.join(30)
    return result["value"]


@pytest.mark.django_db
def test_a_job_is_sent_to_the_training_queue_from_any_thread_even_after_a_health_check(client):
    """The bug a running platform had: a health check's second Celery app became the app that
    other threads (the web server's) sent tasks with, and jobs went to a queue nobody reads."""
    in_new_thread(lambda: client.get("/healthz"))
    published = []

    def record(sender, routing_key, **_):
        published.append((sender, routing_key))

    before_task_publish.connect(record, weak=False)
    try:
        assert in_new_thread(lambda: current_app._get_current_object()) is app
        in_new_thread(lambda: send(TAKE_TRAINING_TURN, "ftjob-nonexistent"))  # a trainer just finds nothing to claim
        in_new_thread(lambda: worker_report.delay())
    finally:
        before_task_publish.disconnect(record)
    assert published == [(TAKE_TRAINING_TURN.name, "training"), (WORKER_REPORT.name, "default")]
