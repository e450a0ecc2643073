"""Faults, with real processes: the platform loses no job when its parts fail.

Slow (each scenario starts its own processes and trains), so they run once per CI run: the test
command runs them on PostgreSQL only (marker ``fault``).
"""

import time

import httpx
import pytest
import redis

from finetuning.models import FineTuningJob, JobStatus
from tests.file_uploads import upload
from tests.fine_tuning_jobs import ONE_STEP, wait_for
from tests.inference_fixtures import BASE
from tests.personas import good_dataset
from tests.processes import SWEEPS_OFTEN, celery_worker_command, free_port, redis_server, running, running_web

pytestmark = [pytest.mark.fault, pytest.mark.training, pytest.mark.django_db(transaction=True)]


def test_jobs_queued_before_redis_restarts_without_its_data_all_succeed(alice, test_database_url, tmp_path):
    port = free_port()
    environment = {"REDIS_URL": f"redis://127.0.0.1:{port}/0", "DATABASE_URL": test_database_url}
    file_id = upload(alice, good_dataset(12)).json()["id"]
    with redis_server(port, tmp_path), running_web("web-own-redis", environment) as url:
        for suffix in ("one", "two", "three"):  # no trainer runs: the messages wait in Redis
            body = {"model": BASE, "training_file": file_id, "suffix": f"restart-{suffix}", "hyperparameters": ONE_STEP}
            response = httpx.post(f"{url}/v1/fine_tuning/jobs", json=body, headers={"Authorization": f"Bearer {alice.key}"})
            assert response.status_code == 200, response.text
        assert redis.Redis(port=port).llen("training") == 3

    # Redis comes back empty. The worker's beat sweeps; a trainer starts.
    worker = celery_worker_command("default", "sweeper", "--beat", "--schedule", str(tmp_path / "beat"))
    trainer = celery_worker_command("training", "trainer")
    with redis_server(port, tmp_path), running("sweeping-worker", worker, environment | SWEEPS_OFTEN), running("trainer", trainer, environment):
        deadline = time.monotonic() + 480
        while FineTuningJob.objects.exclude(status=JobStatus.SUCCEEDED).exists():
            assert time.monotonic() < deadline, list(FineTuningJob.objects.values_list("suffix", "status"))
            time.sleep(1)
    # The sweeper sends lost jobs again up to the organization's free trainer slots
    # (RUNNING_JOBS_PER_ORGANIZATION); the rest are sent as slots free up. No job is trained twice.
    resent = [job.events.filter(message__contains="was lost").count() for job in FineTuningJob.objects.all()]
    assert all(count <= 1 for count in resent) and sum(resent) >= 1, resent
    assert all(job.attempts == 1 for job in FineTuningJob.objects.all())


def test_a_job_longer_than_the_time_limit_fails_saying_what_to_change_and_the_trainer_takes_the_next_job(
    alice, test_database_url, tmp_path
):
    port = free_port()
    environment = {"REDIS_URL": f"redis://127.0.0.1:{port}/0", "DATABASE_URL": test_database_url}
    file_id = upload(alice, good_dataset(12)).json()["id"]
    # Long enough to be past the trainer's imports and the model's loading (a limit that interrupts an
    # import leaves the process unable to import that module again), far too short for 600 steps.
    limit = {"JOB_TIME_LIMIT_SECONDS": "20"}
    trainer = celery_worker_command("training", "trainer-time-limit")
    with (
        redis_server(port, tmp_path),
        running_web("web-own-redis", environment) as url,
        running("trainer-time-limit", trainer, {**environment, **limit}) as process,
    ):
        job_ids = []
        for suffix, hyperparameters in (("too-long", {"n_epochs": 50, "batch_size": 1}), ("next", ONE_STEP)):
            body = {"model": BASE, "training_file": file_id, "suffix": suffix, "hyperparameters": hyperparameters}
            response = httpx.post(f"{url}/v1/fine_tuning/jobs", json=body, headers={"Authorization": f"Bearer {alice.key}"})
            assert response.status_code == 200, response.text
            job_ids.append(response.json()["id"])
        too_long, following = (wait_for(job_id, lambda job: job.is_finished, timeout_s=120) for job_id in job_ids)
        assert process.poll() is None, "the trainer died"

    assert (too_long.status, too_long.error_code, too_long.attempts) == (JobStatus.FAILED, "time_limit_exceeded", 1)
    assert "20 seconds" in too_long.error_message and "n_epochs (it is 50)" in too_long.error_message
    assert "JOB_TIME_LIMIT_SECONDS" in too_long.error_message
    # The same worker took the next job (which may or may not fit in 20 seconds on a busy machine).
    assert following.worker == too_long.worker and following.attempts == 1
    assert following.status == JobStatus.SUCCEEDED or following.error_code == "time_limit_exceeded", following.error_message
