import pytest
from django.db import connection

from workers.tasks import worker_report


@pytest.mark.django_db(transaction=True)
def test_a_task_travels_the_real_broker_to_a_worker_process_that_reaches_the_database(celery_worker):
    report = worker_report.delay().get(timeout=60)
    assert report["database"] == {"ok": True, "detail": connection.vendor}
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in report["models_with_weights"]


def test_tasks_travel_as_json_only():
    from workers.celery_app import app

    assert app.conf.task_serializer == "json" and app.conf.accept_content == ["json"]
    assert app.amqp.router.route({}, "workers.tasks.train_job")["queue"].name == "training"
