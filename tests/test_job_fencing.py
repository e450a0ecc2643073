"""A running job's worker is given up on only when it is gone, and a worker given up on while still
alive (a long pause, a network split) stops without touching what the next attempt does."""

import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings

from finetuning import job_status, training_turns
from finetuning.models import FineTunedModel, FineTuningJob, JobStatus
from tests.fine_tuning_jobs import launch, wait_for
from tests.inference_fixtures import BASE

pytestmark = [pytest.mark.training, pytest.mark.django_db(transaction=True)]


def test_a_job_busy_for_longer_than_the_stale_threshold_between_steps_is_not_given_up_on(alice, celery_worker):
    # Loading the model and one 12-example step each take seconds, with no step ending in between:
    # only a heartbeat of its own keeps the job from looking dead to a 3-second threshold.
    job_id = launch(alice, {"n_epochs": 2, "batch_size": 12}, "steady")
    requeued = []
    while not (job := FineTuningJob.objects.get(pk=job_id)).is_finished:
        requeued += job_status.recover_stale_jobs(timedelta(seconds=3)).requeued
        time.sleep(0.5)
    assert requeued == [] and job.status == JobStatus.SUCCEEDED and job.attempts == 1, job.error_message


def give_up_on(job_id: str) -> None:
    """What the sweeper does to a job whose heartbeat is stale, done to a job whose worker lives."""
    for _ in range(10):  # a beat landing between the two statements makes the recovery a no-op
        FineTuningJob.objects.filter(pk=job_id).update(heartbeat_at="2020-01-01T00:00:00Z")
        if job_status.recover_stale_jobs(timedelta(minutes=1)).requeued == [job_id]:
            training_turns.send_to_trainer(job_id)
            return
    raise AssertionError("the job could not be given up on")


def test_an_attempt_given_up_on_while_alive_stops_and_the_next_one_resumes_from_its_checkpoint(alice, celery_worker):
    job_id = launch(alice, {"n_epochs": 3, "batch_size": 2}, "fenced")  # 6 steps an epoch
    wait_for(job_id, lambda job: job.checkpoints.exists())
    give_up_on(job_id)  # the worker still trains attempt 1; it must notice and stop

    job = wait_for(job_id, lambda job: job.is_finished)
    assert job.status == JobStatus.SUCCEEDED and job.attempts == 2, job.error_message
    events = list(job.events.order_by("created_at", "pk"))
    messages = [event.message for event in events]
    given_up = next(i for i, message in enumerate(messages) if "queued again" in message)
    resumed = next(i for i, message in enumerate(messages) if message.startswith("Resuming after epoch"))
    assert given_up < resumed, "attempt 1 dropped the training state attempt 2 needed"
    checkpoint_step = int(messages[resumed].split("(step ")[1].split(")")[0])
    steps_after = [event.data["step"] for event in events[given_up:] if event.type == "metrics"]
    assert steps_after == list(range(checkpoint_step + 1, 19)), "attempt 1 went on writing after it lost the job"
    assert FineTunedModel.objects.filter(job_id=job_id).count() == 1
    assert (Path(settings.CONFIG.dynamic_lora_path) / f"{BASE}:fenced" / "adapter_model.safetensors").is_file()
