"""Fine-tuning jobs for tests: launched through the API and waited for in the database, or their rows
written as a succeeded job leaves them (a model at its first revision, a revision published)."""

from __future__ import annotations

import time

from django.conf import settings
from django.db import transaction

from finetuning import publishing
from finetuning.job_creation import resolve_hyperparameters
from finetuning.models import FineTunedModel, FineTuningJob, JobStatus, ModelRevision
from tests.file_uploads import upload
from tests.inference_fixtures import BASE, adapter_store
from tests.personas import good_dataset

ONE_STEP = {"n_epochs": 1, "batch_size": 12}


def launch(persona, hyperparameters: dict, suffix: str) -> str:
    file_id = upload(persona, good_dataset(12)).json()["id"]
    body = {"model": BASE, "training_file": file_id, "suffix": suffix, "hyperparameters": hyperparameters}
    response = persona.api.post("/v1/fine_tuning/jobs", body, format="json")
    assert response.status_code == 200, response.json()
    return response.json()["id"]


def wait_for(job_id: str, condition, timeout_s: float = 420) -> FineTuningJob:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = FineTuningJob.objects.get(pk=job_id)
        if condition(job):
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} still {job.status} after {timeout_s} s: {job.error_message}")


def wait_for_job(job_id: str, condition, timeout_s: float = 300) -> FineTuningJob:
    deadline = time.monotonic() + timeout_s
    while not condition(job := FineTuningJob.objects.get(pk=job_id)):
        assert time.monotonic() < deadline, f"{job_id} is still {job.status}: {job.error_message}"
        time.sleep(0.5)
    return job


def trained(persona, suffix: str, parent: str | None = None, **lora) -> FineTunedModel:
    """A model as a succeeded job leaves it, at its first revision (no adapter published: these
    tests never train it). ``parent``: the job's exact parent."""
    hyperparameters = resolve_hyperparameters(lora, 12, settings.MODEL_CATALOG.get(BASE))
    job = FineTuningJob.objects.create(
        organization=persona.organization, model=BASE, parent_model=parent, training_file="file-gone", suffix=suffix,
        seed=0, hyperparameters=hyperparameters, status=JobStatus.SUCCEEDED, fine_tuned_model=f"{BASE}:{suffix}",
    )
    model = FineTunedModel.objects.create(
        name=f"{BASE}:{suffix}", organization=persona.organization, job=job, base_model=BASE, suffix=suffix
    )
    ModelRevision.objects.create(model=model, number=1, job=job)
    return model


def _publish_revision(name: str, folder, number: int) -> None:
    """What a worker does when a job under the model's own suffix succeeds: the revision to the
    dynamic path, then ``finetuning.publishing.publish_trained_revision`` (the registry, and the link moved)."""
    model = FineTunedModel.objects.get(name=name)
    job = FineTuningJob.objects.create(
        organization=model.organization, model=BASE, parent_model=name, training_file="file-gone", suffix=model.suffix,
        revision=number, seed=0, hyperparameters={}, status=JobStatus.SUCCEEDED, fine_tuned_model=name,
    )
    adapter_store().write_revision(name, number, folder)
    with transaction.atomic():
        publishing.publish_trained_revision(job, name, final_loss=None)
