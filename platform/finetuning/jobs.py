"""Fine-tuning jobs: creation (every check before anything is queued), cancellation, listing."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from django.conf import settings
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.utils import timezone

from accounts.models import Organization
from core.api_errors import ApiError
from core.catalog import BaseModel
from core.model_names import ModelName, is_valid_suffix
from finetuning.events import record_event
from finetuning.models import File, FineTuningJob, JobStatus
from server.api_errors import not_found

AUTO = "auto"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BASE_LEARNING_RATE = 2e-4  # learning_rate_multiplier scales this (OpenAI's contract)


@dataclass
class JobRequest:
    """A validated request body (types already checked by the API layer)."""

    model: str
    training_file: str
    validation_file: str | None = None
    suffix: str | None = None
    seed: int | None = None
    hyperparameters: dict = field(default_factory=dict)
    metadata: dict | None = None


def _base_model(model_id: str) -> BaseModel:
    model = settings.MODEL_CATALOG.get(model_id)
    if model is None:
        available = ", ".join(settings.MODEL_CATALOG.ids)
        raise ApiError(f"Model '{model_id}' cannot be fine-tuned here; choose one of: {available}", param="model", code="model_not_available")
    return model


def _file(organization: Organization, file_id: str, param: str, model: BaseModel) -> File:
    file = File.objects.for_org(organization).filter(pk=file_id).first()
    if file is None:
        raise not_found("file", file_id, param=param)
    if file.max_example_tokens > model.engine.max_model_len:
        raise ApiError(
            f"File {file_id} has an example of {file.max_example_tokens} tokens; {model.id} takes at most "
            f"{model.engine.max_model_len}.", param=param, code="invalid_file",
        )  # fmt: skip
    return file


def _suffix(requested: str | None) -> str:
    if requested is None:
        return "ft-" + secrets.token_hex(4)  # the platform names it; the unique constraint still guards
    if not is_valid_suffix(requested):
        raise ApiError(
            "suffix may hold only letters, digits, '-' and '_', at most 64 characters", param="suffix", code="invalid_suffix"
        )
    return requested


def resolve_hyperparameters(requested: dict, examples: int, model: BaseModel) -> dict:
    """Turn every "auto" into a number, so the job records exactly what it will train with."""
    batch_size = requested.get("batch_size", AUTO)
    batch_size = min(8, max(1, examples // 16)) if batch_size == AUTO else batch_size
    n_epochs = requested.get("n_epochs", AUTO)
    if n_epochs == AUTO:
        # Small datasets need more passes to show an effect (like OpenAI's "auto"): about 300
        # examples seen in all, between 3 and 10 epochs.
        n_epochs = 3 if examples >= 100 else min(10, max(3, -(-300 // examples)))
    multiplier = requested.get("learning_rate_multiplier", AUTO)
    multiplier = 1.0 if multiplier == AUTO else float(multiplier)
    lora_r = requested.get("lora_r", 8)
    if lora_r > model.lora.max_lora_rank:
        raise ApiError(
            f"lora_r={lora_r} exceeds {model.id}'s max_lora_rank of {model.lora.max_lora_rank}",
            param="hyperparameters.lora_r", code="invalid_hyperparameter",
        )  # fmt: skip
    target_modules = requested.get("target_modules") or list(TARGET_MODULES)
    unknown = sorted(set(target_modules) - set(TARGET_MODULES))
    if unknown:
        raise ApiError(
            f"target_modules has unknown modules {unknown}; choose from {list(TARGET_MODULES)}",
            param="hyperparameters.target_modules", code="invalid_hyperparameter",
        )  # fmt: skip
    return {
        "n_epochs": n_epochs,
        "batch_size": batch_size,
        "learning_rate_multiplier": multiplier,
        "lora_r": lora_r,
        "lora_alpha": requested.get("lora_alpha", 2 * lora_r),
        "lora_dropout": requested.get("lora_dropout", 0.05),
        "target_modules": target_modules,
    }


def create_job(organization: Organization, user: User | None, request: JobRequest) -> FineTuningJob:
    model = _base_model(request.model)
    training = _file(organization, request.training_file, "training_file", model)
    validation = _file(organization, request.validation_file, "validation_file", model) if request.validation_file else None
    suffix = _suffix(request.suffix)
    hyperparameters = resolve_hyperparameters(request.hyperparameters, training.example_count, model)
    try:
        with transaction.atomic():
            job = FineTuningJob.objects.create(
                organization=organization, created_by=user, model=model.id, training_file=training.id,
                validation_file=validation.id if validation else None, suffix=suffix,
                seed=request.seed if request.seed is not None else secrets.randbelow(2**31),
                hyperparameters=hyperparameters, metadata=request.metadata, status=JobStatus.VALIDATING_FILES,
            )  # fmt: skip
            record_event(job, f"Validated training file: {training.example_count} examples, {training.token_count} tokens")
            FineTuningJob.objects.filter(pk=job.pk).update(status=JobStatus.QUEUED)
            job.status = JobStatus.QUEUED
            record_event(job, "Job queued")
            _enqueue_on_commit(job.id)
    except IntegrityError:
        raise ApiError(
            f"Suffix '{suffix}' is taken for {model.id}: '{ModelName(model.id, suffix)}' already exists or is being trained.",
            status=409, param="suffix", code="suffix_taken",
        ) from None  # fmt: skip
    return job


def _enqueue_on_commit(job_id: str) -> None:
    from workers.tasks import train_job

    # Only after the commit can a worker see the job; a rolled-back job is never queued.
    transaction.on_commit(lambda: train_job.delay(job_id))


def cancel_job(job: FineTuningJob) -> FineTuningJob:
    # Conditional, so a job that finished a moment ago is not turned into "cancelled".
    updated = (
        FineTuningJob.objects.filter(pk=job.pk, status__in=(JobStatus.VALIDATING_FILES, JobStatus.QUEUED, JobStatus.RUNNING))
        .update(status=JobStatus.CANCELLED, finished_at=timezone.now())
    )  # fmt: skip
    job.refresh_from_db()
    if not updated:
        raise ApiError(f"Job {job.id} has already {job.status}; only unfinished jobs can be cancelled.", status=409, code="job_finished")
    record_event(job, "Job cancelled by request")
    return job
