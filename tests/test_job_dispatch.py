# ruff: noqa: F811 (pytest fixtures are imported from tests.helpers, then named as arguments)
"""How queued jobs reach trainers: never silently stuck, whatever the broker does."""

from dataclasses import replace
from datetime import timedelta

import httpx
import pytest
from django.conf import settings
from django.utils import timezone

from finetuning.models import FineTuningJob, JobStatus
from base.celery import TAKE_TRAINING_TURN, waiting_task_args
from tests.file_uploads import upload
from tests.fine_tuning_jobs import ONE_STEP, launch, wait_for
from tests.helpers import web_without_broker  # noqa: F401 (a fixture)
from tests.inference_fixtures import BASE
from tests.personas import good_dataset
from workers.sweep import sweep

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.training
def test_a_job_created_while_the_broker_is_down_answers_503_stays_queued_and_the_sweeper_starts_it(
    alice, web_without_broker, celery_worker
):
    file_id = upload(alice, good_dataset(12)).json()["id"]
    response = httpx.post(
        f"{web_without_broker}/v1/fine_tuning/jobs", headers={"Authorization": f"Bearer {alice.key}"},
        json={"model": BASE, "training_file": file_id, "suffix": "patient", "hyperparameters": ONE_STEP}, timeout=60,
    )
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "broker_unavailable" and "do not create it again" in error["message"]
    job = FineTuningJob.objects.get(suffix="patient")
    assert job.status == JobStatus.QUEUED
    assert job.events.filter(message__contains="could not be sent to a trainer").exists()

    # The broker is back (this process's is up): the sweeper's next pass sends the job.
    assert sweep(lost_after=timedelta(0))["resent"] == [job.id]
    job = wait_for(job.id, lambda job: job.is_finished)
    assert job.status == JobStatus.SUCCEEDED, job.error_message


def test_a_queued_job_is_lost_once_its_message_is_missing_for_lost_message_seconds(alice, not_queued, settings):
    lost = launch(alice, ONE_STEP, "missing")  # never sent
    FineTuningJob.objects.filter(pk=lost).update(queued_at=timezone.now() - timedelta(seconds=30))
    assert sweep()["resent"] == []  # missing for 30 s: not yet lost by the default 60
    settings.CONFIG = replace(settings.CONFIG, lost_message_s=20)
    assert sweep()["resent"] == [lost]


def test_the_sweeper_sends_again_only_a_queued_job_whose_message_the_broker_lost(alice, not_queued, monkeypatch):
    lost = launch(alice, ONE_STEP, "lost")  # never sent: as if the broker restarted without its data
    monkeypatch.undo()  # from here on, jobs are sent for real
    assert lost not in waiting_task_args(settings.CELERY_BROKER_URL, TAKE_TRAINING_TURN)
    assert sweep()["resent"] == []  # not yet: a message may take a moment to arrive
    resent = sweep(lost_after=timedelta(0))["resent"]
    assert resent == [lost]
    held = waiting_task_args(settings.CELERY_BROKER_URL, TAKE_TRAINING_TURN)
    assert lost in held or FineTuningJob.objects.get(pk=lost).status != JobStatus.QUEUED
    assert FineTuningJob.objects.get(pk=lost).events.filter(message__contains="was lost").count() == 1
    alice.api.post(f"/v1/fine_tuning/jobs/{lost}/cancel")  # a session worker, if any, need not train it


def test_a_queued_job_says_how_many_jobs_are_ahead_and_when_no_trainer_is_connected(alice, not_queued, settings):
    first = launch(alice, ONE_STEP, "first")
    second = launch(alice, ONE_STEP, "second")
    assert FineTuningJob.objects.get(pk=first).events.filter(message="Job queued; no job ahead").exists()
    assert FineTuningJob.objects.get(pk=second).events.filter(message="Job queued; 1 job ahead").exists()

    settings.CELERY_BROKER_URL = "redis://127.0.0.1:6379/9"  # a live broker that no trainer reads
    assert sweep()["trainers"] == 0
    sweep()  # a second pass says nothing new
    for job_id in (first, second):
        notes = FineTuningJob.objects.get(pk=job_id).events.filter(message__startswith="No trainer is connected")
        assert notes.count() == 1
