"""A trainer that dies or cannot write, with real processes: no job is lost or stuck, and no half
adapter is ever published.

Each test runs its own web process and workers on a Redis database of their own, so the session's
worker never takes these jobs. Slow (they train), so they run once per CI run (marker ``fault``).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
from pathlib import Path

import httpx
import psutil
import pytest
import redis

from finetuning.models import FineTunedModel, JobStatus
from tests.file_uploads import upload
from tests.fine_tuning_jobs import ONE_STEP, wait_for_job
from tests.inference_fixtures import BASE
from tests.personas import good_dataset
from tests.processes import SWEEPS_OFTEN, celery_worker_command, free_port, running, running_web

pytestmark = [pytest.mark.fault, pytest.mark.training, pytest.mark.django_db(transaction=True)]

REDIS_URL = "redis://127.0.0.1:6379/11"  # neither the suite's broker nor a user's


@pytest.fixture
def platform(alice, test_database_url):
    """A web process on the test database and its own broker; yields (url, create_job)."""
    redis.Redis.from_url(REDIS_URL).flushdb()
    environment = {"REDIS_URL": REDIS_URL, "DATABASE_URL": test_database_url}
    file_id = upload(alice, good_dataset(12)).json()["id"]
    with running_web("web-worker-faults", environment) as url:

        def create_job(suffix: str, hyperparameters: dict) -> str:
            body = {"model": BASE, "training_file": file_id, "suffix": suffix, "hyperparameters": hyperparameters}
            response = httpx.post(f"{url}/v1/fine_tuning/jobs", json=body, headers={"Authorization": f"Bearer {alice.key}"})
            assert response.status_code == 200, response.text
            return response.json()["id"]

        yield environment, create_job


def trainer_child(trainer: subprocess.Popen) -> psutil.Process:
    """The prefork child that runs the task: what the kernel's OOM killer would take."""
    children = psutil.Process(trainer.pid).children()
    assert len(children) == 1, children
    return children[0]


def test_a_trainer_killed_mid_step_is_recovered_by_the_scheduled_sweeper_and_the_job_succeeds(platform, tmp_path):
    environment, create_job = platform
    job_id = create_job("killed-mid-step", {"n_epochs": 3, "batch_size": 2})  # 6 steps an epoch
    sweeper = celery_worker_command("default", "sweeper", "--beat", "--schedule", str(tmp_path / "beat"))
    with running("sweeper", sweeper, environment | SWEEPS_OFTEN), running("trainer", celery_worker_command("training", "trainer"), environment) as trainer:
        wait_for_job(job_id, lambda job: job.events.filter(type="metrics").exists(), 240)
        trainer_child(trainer).send_signal(signal.SIGKILL)
        job = wait_for_job(job_id, lambda job: job.is_finished, 420)  # nobody calls the sweeper but beat
    assert job.status == JobStatus.SUCCEEDED and job.attempts == 2, job.error_message
    assert job.events.filter(message__contains="stopped responding").count() == 1
    assert FineTunedModel.objects.filter(job_id=job_id).count() == 1


@contextlib.contextmanager
def small_filesystem(folder: Path, size: str):
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"a full disk needs a small filesystem, and mount failed: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_publishing_onto_a_full_disk_fails_the_job_plainly_and_publishes_nothing(platform, tmp_path):
    environment, create_job = platform
    with small_filesystem(tmp_path / "tiny", "1m") as tiny:  # an adapter is about 10 MB
        job_id = create_job("disk-full", ONE_STEP)
        trainer = celery_worker_command("training", "trainer-full-disk")
        with running("trainer-full-disk", trainer, {**environment, "DYNAMIC_LORA_PATH": str(tiny)}):
            job = wait_for_job(job_id, lambda job: job.is_finished)
        assert job.status == JobStatus.FAILED and job.error_code == "storage_full", job.error_message
        assert "disk space" in job.error_message and "Nothing was published" in job.error_message
        assert not (tiny / f"{BASE}:disk-full").exists()
        assert not [path for path in tiny.rglob("*") if path.is_file()]  # no partial copy left behind
    assert not FineTunedModel.objects.filter(job_id=job_id).exists()


def test_publishing_to_an_unreachable_s3_fails_the_job_plainly(platform):
    environment, create_job = platform
    job_id = create_job("s3-down", ONE_STEP)
    s3_down = {"DYNAMIC_LORA_PATH": "s3://adapters/down", "S3_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}
    with running("trainer-s3-down", celery_worker_command("training", "trainer-s3-down"), {**environment, **s3_down}):
        job = wait_for_job(job_id, lambda job: job.is_finished)
    assert job.status == JobStatus.FAILED and job.error_code == "storage_unavailable", job.error_message
    assert not FineTunedModel.objects.filter(job_id=job_id).exists()


def test_a_checkpoint_onto_a_full_disk_fails_the_job_plainly(platform, tmp_path):
    from finetuning import storage
    from finetuning.models import File

    environment, create_job = platform
    with small_filesystem(tmp_path / "tiny-files", "256k") as tiny:  # room for the dataset, not a checkpoint
        training = File.objects.get()
        (tiny / training.storage_key).parent.mkdir(parents=True, exist_ok=True)
        (tiny / training.storage_key).write_bytes(storage.files().get(training.storage_key))
        job_id = create_job("checkpoint-disk-full", ONE_STEP)
        trainer = celery_worker_command("training", "trainer-full-files")
        with running("trainer-full-files", trainer, {**environment, "FILES_PATH": str(tiny)}):
            job = wait_for_job(job_id, lambda job: job.is_finished)
    assert job.status == JobStatus.FAILED and job.error_code == "storage_full", job.error_message
    assert not FineTunedModel.objects.filter(job_id=job_id).exists()
