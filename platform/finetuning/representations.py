"""API objects in OpenAI's shape (ids, unix timestamps, "object" names)."""

from __future__ import annotations


from base.records import unix
from finetuning.models import (
    Checkpoint,
    Composition,
    CompositionStatus,
    File,
    FineTunedModel,
    FineTuningJob,
    JobEvent,
    ModelRevision,
)


def file_object(file: File) -> dict:
    return {
        "id": file.id,
        "object": "file",
        "bytes": file.bytes,
        "created_at": unix(file.created_at),
        "filename": file.filename,
        "purpose": file.purpose,
        "status": "processed",
        "status_details": None,
        # Beyond OpenAI's object: what the platform found in the file.
        "example_count": file.example_count,
        "token_count": file.token_count,
    }


def job_object(job: FineTuningJob) -> dict:
    error = {"code": job.error_code, "message": job.error_message, "param": None} if job.error_code else None
    hp = job.hyperparameters
    return {
        "id": job.id,
        "object": "fine_tuning.job",
        "created_at": unix(job.created_at),
        "finished_at": unix(job.finished_at),
        "model": job.parent_model or job.model,  # as the caller named it (a continued fine-tune: its parent)
        # Beyond OpenAI's object: exactly the adapter a continued fine-tune trains on from (a revision
        # or a checkpoint), None for a fine-tune of the base model.
        "parent_model": job.exact_parent,
        "fine_tuned_model": job.fine_tuned_model,
        "organization_id": job.organization.slug,
        "status": job.status,
        "trained_tokens": job.trained_tokens,
        "hyperparameters": hp,
        # OpenAI's shape: the type, and its settings under its name (a DPO job's include beta, a
        # reinforcement job's its grader).
        "method": {"type": job.method, job.method: {"hyperparameters": hp} | ({"grader": job.grader} if job.grader else {})},
        "training_file": job.training_file,
        "validation_file": job.validation_file,
        "result_files": [job.result_file] if job.result_file else [],
        "error": error,
        "seed": job.seed,
        "suffix": job.suffix,
        "estimated_finish": unix(job.estimated_finish),
        "metadata": job.metadata,
        "integrations": [],
        "revision": job.revision,  # the revision of fine_tuned_model it publishes
        "evaluation": job.evaluation,  # the gate, with its "scores" once scored
        "best_step": job.best_step,  # early stopping: the step whose adapter fine_tuned_model is
    }


def event_object(event: JobEvent) -> dict:
    return {
        "id": event.id,
        "object": "fine_tuning.job.event",
        "created_at": unix(event.created_at),
        "level": event.level,
        "message": event.message,
        "data": event.data,
        "type": event.type,
    }


def checkpoint_object(checkpoint: Checkpoint) -> dict:
    job = checkpoint.job
    return {
        "id": checkpoint.id,
        "object": "fine_tuning.job.checkpoint",
        "created_at": unix(checkpoint.created_at),
        "fine_tuned_model_checkpoint": checkpoint.name,
        "fine_tuning_job_id": job.id,
        "step_number": checkpoint.step_number,
        "metrics": {
            "step": checkpoint.step_number,
            "train_loss": checkpoint.metrics.get("train_loss"),
            "valid_loss": checkpoint.metrics.get("valid_loss"),
            "full_valid_loss": checkpoint.metrics.get("valid_loss"),
        },
    }


def model_object(model: FineTunedModel) -> dict:
    """As ``/v1/models`` lists it."""
    return {
        "id": model.name,
        "object": "model",
        "created": unix(model.created_at),
        "owned_by": model.organization.slug,
        "parent": model.base_model,
        "lineage": model.lineage,
        "revision": model.revision,
    }


def revision_object(revision: ModelRevision, current: int) -> dict:
    """One revision of a fine-tuned model, with the job that trained it (None for an uploaded or composed model's)."""
    job = revision.job
    return {
        "id": f"{revision.model.name}@r{revision.number}",
        "object": "model.revision",
        "revision": revision.number,
        "created": unix(revision.created_at),
        "current": revision.number == current,
        "fine_tuning_job_id": job.id if job else None,
        "trained_tokens": job.trained_tokens if job else None,
        "final_loss": revision.final_loss,
    }


def composition_object(composition: Composition) -> dict:
    """A composition built on a worker, shaped like a job: poll it until ``status`` is
    ``succeeded`` (then ``fine_tuned_model`` answers) or ``failed`` (then ``error`` says why)."""
    error = None
    if composition.error_code:
        error = {"code": composition.error_code, "message": composition.error_message, "param": None}
    succeeded = composition.status == CompositionStatus.SUCCEEDED
    return {
        "id": composition.id,
        "object": "fine_tuning.composition",
        "created_at": unix(composition.created_at),
        "started_at": unix(composition.started_at),
        "finished_at": unix(composition.finished_at),
        "organization_id": composition.organization.slug,
        "status": composition.status,
        "model": composition.model,  # the model it publishes
        "fine_tuned_model": composition.model if succeeded else None,
        "parents": composition.parents,
        "method": composition.method,
        "rank": composition.rank,
        "density": composition.density if composition.method in ("ties", "dare_linear") else None,
        "seed": composition.seed if composition.method == "dare_linear" else None,
        "approximation_error": composition.approximation_error,
        "estimated_bytes": composition.estimated_bytes,
        "error": error,
    }
