"""Running a fine-tuning job on a worker: claim it, train, publish the adapter, record the outcome.

Safe to run twice for one job (a redelivered task, a recovered job): only the worker whose
conditional update moves the job from "queued" to "running" trains it; the others return at once.
A worker that dies leaves a stale heartbeat, and ``recover_stale_jobs`` re-queues or fails the job.
"""

from __future__ import annotations

import logging
import shutil
import time
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from core.model_names import ModelName
from core.object_store import ObjectNotFound
from finetuning import storage
from finetuning.events import record_event
from finetuning.files import load_examples
from finetuning.jobs import BASE_LEARNING_RATE
from finetuning.models import Checkpoint, File, FineTunedModel, FineTuningJob, JobStatus

log = logging.getLogger("finetuning.runner")

STALE_AFTER = timedelta(minutes=3)  # no heartbeat for this long: the worker is gone
MAX_ATTEMPTS = 3
_STATUS_POLL_S = 1.0  # how often a running job looks for a cancel between steps


class JobFailed(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def claim(job_id: str, worker: str) -> bool:
    now = timezone.now()
    return bool(
        FineTuningJob.objects.filter(pk=job_id, status=JobStatus.QUEUED).update(
            status=JobStatus.RUNNING, worker=worker, started_at=now, heartbeat_at=now, attempts=F("attempts") + 1
        )
    )


class JobCallbacks:
    """The trainer's window onto the job: metrics become events, cancel is read from the database."""

    def __init__(self, job: FineTuningJob):
        self.job = job
        self.store = storage.files()
        self._checked_at = 0.0
        self._stop = False

    def _heartbeat(self, **fields) -> None:
        FineTuningJob.objects.filter(pk=self.job.pk).update(heartbeat_at=timezone.now(), **fields)

    def on_step(self, metrics) -> None:
        steps_this_run = max(metrics.step - metrics.resumed_at_step, 1)
        remaining_s = metrics.elapsed_s / steps_this_run * (metrics.total_steps - metrics.step)
        message = f"Step {metrics.step}/{metrics.total_steps}: training loss={metrics.train_loss:.4f}"
        if metrics.valid_loss is not None:
            message += f", validation loss={metrics.valid_loss:.4f}"
        record_event(self.job, message, data=_metrics_data(metrics))
        self._heartbeat(estimated_finish=timezone.now() + timedelta(seconds=remaining_s))

    def on_checkpoint(self, epoch: int, step: int, adapter_dir: Path, metrics) -> None:
        prefix = f"checkpoints/{self.job.pk}/step-{step}"
        for file in adapter_dir.iterdir():
            self.store.put_file(f"{prefix}/{file.name}", file)
        Checkpoint.objects.create(job=self.job, step_number=step, epoch=epoch, metrics=_metrics_data(metrics), storage_key=prefix)
        record_event(self.job, f"Checkpoint saved after epoch {epoch} (step {step})")

    def should_stop(self) -> bool:
        now = time.monotonic()
        if not self._stop and now - self._checked_at >= _STATUS_POLL_S:
            self._checked_at = now
            self._stop = FineTuningJob.objects.filter(pk=self.job.pk).values_list("status", flat=True).first() != JobStatus.RUNNING
            self._heartbeat()
        return self._stop


def _metrics_data(metrics) -> dict:
    return {
        "step": metrics.step,
        "total_steps": metrics.total_steps,
        "epoch": metrics.epoch,
        "train_loss": metrics.train_loss,
        "valid_loss": metrics.valid_loss,
        "tokens_per_second": metrics.tokens_per_second,
        "trained_tokens": metrics.trained_tokens,
    }


def _examples(job: FineTuningJob, file_id: str | None, what: str) -> list | None:
    if file_id is None:
        return None
    file = File.objects.filter(pk=file_id).first()
    if file is None:
        raise JobFailed("invalid_file", f"The {what} file {file_id} was deleted before the job started.")
    return load_examples(file)


def _train(job: FineTuningJob, workdir: Path, callbacks: JobCallbacks):
    from workers.training import TrainingConfig, train  # deferred: torch is only for workers

    model = settings.MODEL_CATALOG.get(job.model)
    if model is None:
        raise JobFailed("model_not_available", f"Model {job.model} is no longer in the catalog.")
    hp = job.hyperparameters
    config = TrainingConfig(
        base_model_path=model.weights, base_model_id=model.id, n_epochs=hp["n_epochs"], batch_size=hp["batch_size"],
        learning_rate=BASE_LEARNING_RATE * hp["learning_rate_multiplier"], lora_r=hp["lora_r"],
        lora_alpha=hp["lora_alpha"], lora_dropout=hp["lora_dropout"], target_modules=list(hp["target_modules"]),
        seed=job.seed, max_seq_len=model.engine.max_model_len,
    )  # fmt: skip
    training = _examples(job, job.training_file, "training")
    validation = _examples(job, job.validation_file, "validation")
    resume_from = _resume_point(job, workdir / "resume")
    record_event(job, f"Training started on {len(training)} examples")
    return train(config, training, validation, workdir, callbacks, resume_from=resume_from)


def _resume_point(job: FineTuningJob, folder: Path) -> Path | None:
    """The latest epoch checkpoint an earlier attempt of this job saved, fetched into ``folder``;
    None when there is none: training starts from the beginning."""
    from workers.training.model import ADAPTER_FILES
    from workers.training.state import TRAINING_STATE_FILE

    checkpoint = job.checkpoints.order_by("-step_number").first()
    if checkpoint is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    store = storage.files()
    try:
        for name in (*ADAPTER_FILES, TRAINING_STATE_FILE):
            (folder / name).write_bytes(store.get(f"{checkpoint.storage_key}/{name}"))
    except ObjectNotFound as exc:
        record_event(job, f"Checkpoint {checkpoint.id} is incomplete (no {exc}); training starts over", level="warn")
        return None
    record_event(job, f"Resuming after epoch {checkpoint.epoch} (step {checkpoint.step_number}) from checkpoint {checkpoint.id}")
    return folder


def _publish(job: FineTuningJob, result) -> None:
    model = settings.MODEL_CATALOG.get(job.model)
    name = str(ModelName(job.model, job.suffix))
    store = storage.adapters(model.lora.dynamic_lora_loading_path)
    store.publish(name, result.adapter_dir)
    with transaction.atomic():
        succeeded = FineTuningJob.objects.filter(pk=job.pk, status=JobStatus.RUNNING).update(
            status=JobStatus.SUCCEEDED, fine_tuned_model=name, trained_tokens=result.trained_tokens,
            finished_at=timezone.now(), estimated_finish=None,
        )  # fmt: skip
        if succeeded:
            FineTunedModel.objects.create(
                name=name, organization=job.organization, job=job, base_model=job.model, suffix=job.suffix,
                final_loss=result.final_train_loss,
            )  # fmt: skip
            record_event(job, f"New fine-tuned model created: {name}")
            record_event(job, "The job has successfully completed")
    if not succeeded:  # cancelled while publishing: take the adapter back down
        store.delete(name)


def _drop_training_states(job: FineTuningJob) -> None:
    """A finished job's checkpoints keep their adapters (users may fetch them); the training state
    beside each, twice an adapter's size, only ever served a resume."""
    from workers.training.state import TRAINING_STATE_FILE

    store = storage.files()
    for storage_key in job.checkpoints.values_list("storage_key", flat=True):
        store.delete_prefix(f"{storage_key}/{TRAINING_STATE_FILE}")


def _fail(job_id: str, code: str, message: str) -> None:
    failed = FineTuningJob.objects.filter(pk=job_id, status=JobStatus.RUNNING).update(
        status=JobStatus.FAILED, error_code=code, error_message=message, finished_at=timezone.now(), estimated_finish=None
    )
    if failed:
        record_event(FineTuningJob.objects.get(pk=job_id), f"Job failed: {message}", level="error")


def run_job(job_id: str, worker: str) -> str:
    """Train and publish one job; returns what happened, for the worker's log."""
    if not claim(job_id, worker):
        return "not claimed (another worker has it, or it is no longer queued)"
    job = FineTuningJob.objects.select_related("organization").get(pk=job_id)
    workdir = settings.DATA_DIR / "work" / job.pk
    try:
        result = _train(job, workdir, JobCallbacks(job))
        if result.cancelled:
            return "cancelled"
        _publish(job, result)
        return "succeeded"
    except JobFailed as exc:
        _fail(job_id, exc.code, exc.message)
        return "failed"
    except Exception as exc:  # a bug or a broken environment: the user still gets a reason
        log.exception("job %s failed", job_id)
        _fail(job_id, "training_failed", f"Training failed: {type(exc).__name__}: {exc}")
        return "failed"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        _drop_training_states(job)  # finished, whichever way: no attempt will resume it


def recover_stale_jobs(stale_after: timedelta = STALE_AFTER) -> list[str]:
    """Re-queue jobs whose worker stopped sending heartbeats (or fail them after MAX_ATTEMPTS)."""
    from workers.tasks import train_job

    recovered = []
    cutoff = timezone.now() - stale_after
    for job in FineTuningJob.objects.filter(status=JobStatus.RUNNING, heartbeat_at__lt=cutoff):
        # Conditional on the heartbeat we saw: a worker that is alive after all keeps its job.
        still_stale = FineTuningJob.objects.filter(pk=job.pk, status=JobStatus.RUNNING, heartbeat_at=job.heartbeat_at)
        if job.attempts >= MAX_ATTEMPTS:
            message = f"The worker running this job stopped responding {job.attempts} times; giving up."
            if still_stale.update(status=JobStatus.FAILED, error_code="worker_lost", error_message=message, finished_at=timezone.now()):
                record_event(job, f"Job failed: {message}", level="error")
                _drop_training_states(job)
        elif still_stale.update(status=JobStatus.QUEUED, worker="", heartbeat_at=None):
            record_event(job, f"Worker {job.worker} stopped responding; the job is queued again", level="warn")
            train_job.delay(job.pk)
            recovered.append(job.pk)
    return recovered
