"""Running a fine-tuning job on a worker: claim it, train, evaluate if asked, publish the adapter as
a revision of its model, have the pool load it, record the outcome. Every publish (a checkpoint, the
revision, the preload) is a step of ``finetuning.publishing``.

Safe to run twice for one job (a redelivered task, a recovered job): only the worker whose
conditional update moves the job from "queued" to "running" trains it; the others return at once.
A worker that dies leaves a stale heartbeat, and the sweeper (``workers.sweep``) re-queues or
fails the job. Every change of status is a function of ``finetuning.job_status`` (the claim, of
``finetuning.training_turns``). Every database call waits out a database outage
(``workers.db_retry``).
"""

from __future__ import annotations

import errno
import logging
import shutil
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, cast

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.utils import timezone

from base.database_outage import DATABASE_ERRORS
from core import grading
from core.adapter_store import AdapterNotFound, StoreUnavailable
from core.api_errors import logged_instead, scrubbed
from core.catalog import BaseModel
from core.datasets import Example, PromptItem, Record, as_chat
from core.model_names import ModelName, pinned_name
from core.object_store import ObjectNotFound
from finetuning import job_creation, job_status, publishing, registry, results, storage, training_turns
from finetuning.files import load_examples
from finetuning.models import (
    DPO,
    FINISHED_STATUSES,
    REINFORCEMENT,
    Checkpoint,
    File,
    FineTuningJob,
    JobStatus,
    record_event,
)
from workers import evaluation, run_reinforcement
from workers.db_retry import retrying
from workers.heartbeat import Heartbeat

if TYPE_CHECKING:  # the trainer imports torch: this module imports it only when a job trains
    from workers.training import StepMetrics, TrainingResult
    from workers.training_loop.reinforcement import RewardStep

log = logging.getLogger(__name__)

_STATUS_POLL_S = 1.0  # how often a running job looks for a cancel between steps
EVAL_SCORE_KEY = "eval_score"  # a checkpoint's score in its metrics, when early stopping scores checkpoints


class JobFailed(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class JobCallbacks:
    """The trainer's window onto the job: metrics become events, a cancel or a lost job stops it.

    Every write first beats the heartbeat, which is conditional on this attempt still running the
    job: an attempt that lost the job writes nothing more."""

    def __init__(self, job: FineTuningJob, heartbeat: Heartbeat):
        self.job, self.heartbeat = job, heartbeat
        self.store = storage.files()
        self._checked_at = 0.0
        self._held_out: list[Example] | None = None  # early stopping by eval_score: the evaluation's examples

    def on_step(self, metrics: StepMetrics) -> None:
        message = f"Step {metrics.step}/{metrics.total_steps}: training loss={metrics.train_loss:.4f}"
        if metrics.valid_loss is not None:
            message += f", validation loss={metrics.valid_loss:.4f}"
        if metrics.reward_margin is not None and metrics.preference_accuracy is not None:
            message += f", reward margin={metrics.reward_margin:.4f}, preference accuracy={metrics.preference_accuracy:.2f}"
        if self.heartbeat.beat(estimated_finish=_estimated_finish(metrics)):
            retrying(record_event, self.job, message, data=_metrics_data(metrics))

    def metrics_data(self, metrics: StepMetrics) -> dict:
        return _metrics_data(metrics)

    def on_checkpoint(self, epoch: int, step: int, adapter_dir: Path, metrics: StepMetrics | RewardStep) -> float | None:
        # Each attempt writes under its own prefix: an attempt given up on while it uploads can
        # never mix its files into the checkpoint the next attempt resumes from.
        prefix = f"{storage.checkpoints_prefix(self.job.pk)}attempt-{self.heartbeat.attempt}/step-{step}"
        if not self.heartbeat.beat():
            return None
        for file in adapter_dir.iterdir():
            self.store.put_file(f"{prefix}/{file.name}", file)
        if not self.heartbeat.beat():
            return None
        # Whether it ends its epoch: a resume from it says "after epoch N" or "after step N".
        data = self.metrics_data(metrics) | {"ends_epoch": metrics.ends_epoch}  # type: ignore[arg-type]  # its own kind's
        checkpoint = Checkpoint(job=self.job, step_number=step, epoch=epoch, metrics=data, storage_key=prefix)
        retrying(publishing.publish_checkpoint, checkpoint, adapter_dir)
        return self._score(checkpoint) if _by_score(self.job) else None

    def _score(self, checkpoint: Checkpoint) -> float:
        """The checkpoint's score by the job's graders, answered by the checkpoint as it is served now;
        kept in its metrics (a resume from it starts from that score)."""
        assert self.job.evaluation is not None
        if self._held_out is None:
            self._held_out = [as_chat(r) for r in _examples(self.job, self.job.evaluation["file"], "evaluation")]
        try:
            score = evaluation.checkpoint_score(self.job.organization_id, self.job.evaluation, self._held_out, checkpoint.name)
        except evaluation.EvaluationUnavailable as exc:
            raise JobFailed(
                "evaluation_unavailable",
                f"Checkpoint {checkpoint.name} could not be scored for early stopping: the serving backend did not "
                f"answer {logged_instead(f'job {self.job.pk}: a checkpoint could not be scored', str(exc))}.",
            ) from None
        checkpoint.metrics = checkpoint.metrics | {EVAL_SCORE_KEY: score}
        retrying(checkpoint.save, update_fields=["metrics"])
        message = f"Checkpoint {checkpoint.name} scored {score:.3f} by the job's graders (early stopping)"
        retrying(record_event, self.job, message, data={"step": checkpoint.step_number, EVAL_SCORE_KEY: score})
        return score

    def should_stop(self) -> bool:
        now = time.monotonic()
        if now - self._checked_at >= _STATUS_POLL_S:  # a cancel shows within a second
            self._checked_at = now
            self.heartbeat.beat()
        return self.heartbeat.lost.is_set()


class RewardCallbacks(JobCallbacks):
    """A reinforcement job's: its steps report rewards (``workers.run_reinforcement``)."""

    def on_step(self, metrics: RewardStep) -> None:  # type: ignore[override]
        if self.heartbeat.beat(estimated_finish=_estimated_finish(metrics)):
            retrying(record_event, self.job, run_reinforcement.reward_message(metrics), data=self.metrics_data(metrics))

    def on_evaluation(self, total_steps: int, valid_reward: float, valid_pass_rate: float) -> None:
        if self.heartbeat.beat():
            run_reinforcement.record_base_evaluation(self.job, total_steps, valid_reward, valid_pass_rate)

    def metrics_data(self, metrics: RewardStep) -> dict:  # type: ignore[override]
        return run_reinforcement.reward_data(metrics)


def _estimated_finish(metrics: StepMetrics | RewardStep) -> datetime:
    """When the job will end at the pace of this run's steps so far."""
    steps_this_run = max(metrics.step - metrics.resumed_at_step, 1)
    remaining_s = metrics.elapsed_s / steps_this_run * (metrics.total_steps - metrics.step)
    return timezone.now() + timedelta(seconds=remaining_s)


def _metrics_data(metrics: StepMetrics) -> dict:
    return {
        "step": metrics.step,
        "total_steps": metrics.total_steps,
        "epoch": metrics.epoch,
        "train_loss": metrics.train_loss,
        "valid_loss": metrics.valid_loss,
        "tokens_per_second": metrics.tokens_per_second,
        "trained_tokens": metrics.trained_tokens,
    } | _preference_data(metrics)


def _preference_data(metrics: StepMetrics) -> dict:
    """A DPO step's metrics beside the loss (none for a supervised job's, whose events stay as they were)."""
    if metrics.reward_margin is None:
        return {}
    return {"reward_margin": metrics.reward_margin, "preference_accuracy": metrics.preference_accuracy}


def _catalog_model(job: FineTuningJob) -> BaseModel:
    model = settings.MODEL_CATALOG.get(job.model)
    if model is None:
        raise JobFailed("model_not_available", f"Model {job.model} is no longer in the catalog.")
    return model


def _examples(job: FineTuningJob, file_id: str, what: str) -> list[Record]:
    file = retrying(File.objects.filter(pk=file_id).first)
    if file is None:
        raise JobFailed("invalid_file", f"The {what} file {file_id} was deleted before the job started.")
    return load_examples(file)


def _train(job: FineTuningJob, workdir: Path, callbacks: JobCallbacks) -> TrainingResult:
    from workers.training import TrainingConfig, TrainingDiverged, train  # deferred: torch is only for workers

    model = _catalog_model(job)
    if job.method == REINFORCEMENT:
        return _train_by_reward(job, model, workdir, callbacks)
    hp = job.hyperparameters
    config = TrainingConfig(
        base_model_path=model.weights, base_model_id=model.id, n_epochs=hp["n_epochs"], batch_size=hp["batch_size"],
        learning_rate=job_creation.BASE_LEARNING_RATE * hp["learning_rate_multiplier"], lora_r=hp["lora_r"],
        lora_alpha=hp["lora_alpha"], lora_dropout=hp["lora_dropout"], target_modules=list(hp["target_modules"]),
        seed=job.seed, max_seq_len=model.engine.max_model_len,
        # A job created before these hyperparameters existed evaluates and checkpoints once an epoch, to the end.
        evals_per_epoch=hp.get("n_evals", 1), checkpoints_per_epoch=hp.get("n_checkpoints", 1),
        **_early_stopping(hp.get("early_stopping")), **_preference(job),
    )
    training = _examples(job, job.training_file, "training")
    validation = None if job.validation_file is None else _examples(job, job.validation_file, "validation")
    resume_from, resume_score = _resume_point(job, workdir / "resume")
    # A continued fine-tune starts from its parent's adapter; a resume's checkpoint already holds
    # the adapter (of the parent's shape), so it needs no parent. But DPO's reference is the parent,
    # resumed or not: the policy is measured against where the job started.
    if job.parent_model and (resume_from is None or job.method == DPO):
        parent = _parent_adapter(job, workdir / "parent")
        config.init_adapter = parent if resume_from is None else None
        config.reference_adapter = parent if job.method == DPO else None
    retrying(record_event, job, f"Training started on {len(training)} examples")
    try:
        return train(config, training, validation, workdir, callbacks, resume_from=resume_from, resume_score=resume_score)
    except TrainingDiverged as exc:
        raise JobFailed(
            "training_diverged",
            f"Training diverged: {exc}. Lower learning_rate_multiplier (it is {hp['learning_rate_multiplier']:g}), "
            "or look for examples unlike the rest.",
        ) from None


def _train_by_reward(job: FineTuningJob, model: BaseModel, workdir: Path, callbacks: JobCallbacks) -> TrainingResult:
    """A reinforcement job: sampled, graded and trained step by step; it starts over when resumed (its
    checkpoints keep adapters, not the sampling state a resume would need)."""
    # Prompts lines, as the job's files were checked to hold (``finetuning.job_creation``).
    prompts = cast(list[PromptItem], _examples(job, job.training_file, "training"))
    validation = [] if job.validation_file is None else cast(list[PromptItem], _examples(job, job.validation_file, "validation"))
    earlier = retrying(list, job.checkpoints.select_related("job"))
    if earlier:  # an earlier attempt's: the new attempt's steps will save their own
        for checkpoint in earlier:
            publishing.store_for(job.model).delete(checkpoint.name)
        retrying(job.checkpoints.all().delete)
        retrying(record_event, job, "Starting over: a reinforcement job's checkpoints are adapters to serve, not states to resume", level="warn")
    retrying(record_event, job, f"Training started on {len(prompts)} prompts, {job.hyperparameters['samples_per_prompt']} answers each a step")
    try:
        return run_reinforcement.train_by_reward(job, model.weights, prompts, validation, workdir, cast(RewardCallbacks, callbacks))
    except run_reinforcement.PoolRefused as exc:
        raise JobFailed("sampling_unavailable", f"Training stopped: {exc}. Nothing was published; create the job again once it answers.") from None


def _preference(job: FineTuningJob) -> dict:
    """A DPO job's TrainingConfig fields (its beta is resolved at creation, ``finetuning.job_creation``)."""
    if job.method != DPO:
        return {}
    return {"method": DPO, "beta": job.hyperparameters["beta"]}


def _early_stopping(requested: dict | None) -> dict:
    """The job's ``early_stopping`` ({"patience", "min_delta", "metric"}, or None: off) as TrainingConfig fields."""
    if requested is None:
        return {}
    return {
        "early_stopping_patience": requested["patience"], "early_stopping_min_delta": requested["min_delta"],
        "early_stopping_metric": requested.get("metric", "valid_loss"),  # a job of old watched the validation loss
    }


def _by_score(job: FineTuningJob) -> bool:
    """Early stopping scores each checkpoint with the job's graders (``metric: eval_score``)."""
    return (job.hyperparameters.get("early_stopping") or {}).get("metric") == EVAL_SCORE_KEY


def _parent_adapter(job: FineTuningJob, cache: Path) -> Path:
    """A continued fine-tune's starting adapter, exactly the one the job recorded (a revision or a
    checkpoint), fetched from the dynamic LoRA path now (the trainer may be on another host than the
    web process that created the job)."""
    parent = job.exact_parent
    assert parent is not None
    deleted = JobFailed(
        "parent_model_deleted",
        f"The model to fine-tune further, {parent}, was deleted before the job started; nothing was trained.",
    )
    if retrying(registry.resolve_model, job.organization, parent) is None:
        raise deleted
    try:
        folder = publishing.store_for(job.model).fetch(parent, cache)
    except AdapterNotFound:
        raise deleted from None
    retrying(record_event, job, f"Training goes on from {parent}'s adapter")
    return folder


def _resume_point(job: FineTuningJob, folder: Path) -> tuple[Path | None, float | None]:
    """The latest epoch checkpoint an earlier attempt of this job saved, fetched into ``folder``, and
    its score when early stopping scored it; (None, None) when there is none: training starts over."""
    from workers.training.model import ADAPTER_FILES
    from workers.training.state import TRAINING_STATE_FILE

    checkpoint = retrying(job.checkpoints.order_by("-step_number").first)
    if checkpoint is None:
        return None, None
    folder.mkdir(parents=True, exist_ok=True)
    store = storage.files()
    try:
        for name in (*ADAPTER_FILES, TRAINING_STATE_FILE):
            (folder / name).write_bytes(store.get(f"{checkpoint.storage_key}/{name}"))
    except ObjectNotFound as exc:
        message = f"Checkpoint {checkpoint.id} is incomplete (no {exc}); training starts over"
        retrying(record_event, job, message, level="warn")
        return None, None
    if checkpoint.metrics.get("ends_epoch", True):  # a checkpoint of old ended its epoch
        where = f"epoch {checkpoint.epoch} (step {checkpoint.step_number})"
    else:
        where = f"step {checkpoint.step_number} (within epoch {checkpoint.epoch})"
    message = f"Resuming after {where} from checkpoint {checkpoint.id}"
    retrying(record_event, job, message)
    return folder, checkpoint.metrics.get(EVAL_SCORE_KEY)


def _publish(job: FineTuningJob, heartbeat: Heartbeat, result: TrainingResult) -> None:
    if not heartbeat.beat():
        return  # the job is no longer this attempt's: publish nothing
    _catalog_model(job)  # removed from the catalog while training: the job fails with that reason
    assert result.adapter_dir is not None  # None only for a cancelled run, which publishes nothing
    if result.best_step is not None:
        retrying(record_event, job, _best_step_message(job, result))
    # The revision first, then the registry, which points the name at it (``finetuning.publishing``).
    revision = publishing.write_trained_revision(job, result.adapter_dir)
    if job.evaluation is not None:
        _gate(job, heartbeat, revision)
    results_file = retrying(results.store_results_file, job)
    name = str(ModelName(job.model, job.suffix))
    succeeded = retrying(
        job_status.succeed, job, heartbeat.attempt, name, result.trained_tokens, result.final_train_loss, results_file,
        best_step=result.best_step,
    )
    if succeeded:
        retrying(publishing.announce_ready, job, name)
        return
    results.discard(results_file)
    if retrying(job_status.status_of, job.pk) == JobStatus.CANCELLED:
        publishing.withdraw_trained_revision(job)  # cancelled while publishing: nothing answers with it
    # Otherwise another attempt runs the job now: its own publish replaces this revision, and
    # nothing of its may be deleted here.


def _best_step_message(job: FineTuningJob, result: TrainingResult) -> str:
    """Which step's adapter the job publishes, and why: early stopping chose the best validation loss,
    or the best checkpoint score."""
    assert result.best_step is not None
    early_stopping = job.hyperparameters["early_stopping"]
    if job.method == REINFORCEMENT:
        what = "validation reward" if job.validation_file else "training reward"
    else:
        what = "checkpoint score" if result.best_score is not None else "validation loss"
    if result.stopped_early:
        why = (
            f"Early stopping at step {result.steps}: the {what} had not improved by more than "
            f"{early_stopping['min_delta']:g} in {early_stopping['patience']} evaluation(s) since step {result.best_step}"
        )
    else:
        keeper = "the job" if job.method == REINFORCEMENT else "early stopping"
        why = f"Training ran to its last step, {result.steps}; {keeper} keeps the best {what}"
    best = result.best_score if result.best_score is not None else result.final_valid_loss
    checkpoint = retrying(job.checkpoints.filter(step_number=result.best_step).first)
    also = f"; it is checkpoint {checkpoint.name}" if checkpoint is not None else ""
    return f"{why}. The job's adapter is step {result.best_step}'s, the best {what} ({best:.4f}){also}."


def _gate(job: FineTuningJob, heartbeat: Heartbeat, revision: str) -> None:
    """Publish only a revision that scores well enough (``workers.evaluation``); otherwise the job
    fails with the scores, and the revision written for the evaluation is withdrawn."""
    assert job.evaluation is not None
    reference = _reference(job)
    # A preference file's examples are scored by their preferred answers.
    examples = [as_chat(record) for record in _examples(job, job.evaluation["file"], "evaluation")]
    retrying(record_event, job, f"Evaluating {revision} against {reference} on up to {evaluation.MAX_CASES} held-out examples")
    try:
        scores = evaluation.evaluate(job.organization_id, job.evaluation, examples, reference, revision)
    except evaluation.EvaluationUnavailable as exc:
        publishing.withdraw_trained_revision(job)
        raise JobFailed(
            "evaluation_unavailable",
            f"The evaluation could not run: the serving backend did not answer "
            f"{logged_instead(f'job {job.pk}: the evaluation could not run', str(exc))}. Nothing was published; "
            "create the job again once it answers.",
        ) from None
    retrying(job_status.record_evaluation, job.pk, heartbeat.attempt, scores.as_dict())
    for grader, count in scores.timeouts.items():
        message = (
            f"Evaluation: the {grader} was too slow (over {grading.GRADE_TIMEOUT_S:g} s an answer, and not run again "
            f"after {grading.MAX_TIMEOUTS_PER_GRADER} such answers): {count} answer(s) counted as fails"
        )
        retrying(record_event, job, message, level="warn")
    summary = (
        f"{revision} scored {scores.adapter_score:.3f} and {reference} {scores.reference_score:.3f} "
        f"on {scores.examples} examples (threshold {scores.threshold:+.3f})"
    )
    retrying(record_event, job, f"Evaluation: {summary}", data=scores.as_dict())
    if not scores.passed:
        publishing.withdraw_trained_revision(job)
        raise JobFailed("eval_regression", f"The new adapter did worse than its threshold: {summary}. Nothing was published.")


def _reference(job: FineTuningJob) -> str:
    """What the new revision is compared with: the adapter it trained on from (a job of old recorded
    its parent's bare name: the revision that answers for it now), or the base model."""
    parent = job.exact_parent
    if parent:
        published = publishing.store_for(job.model).version(parent)
        if published is not None:
            return pinned_name(parent, published.version)
    return job.model


def _explained(exc: Exception, job: FineTuningJob) -> JobFailed:
    """Why a job failed, said so a person knows what to change."""
    if isinstance(exc, JobFailed):
        return exc
    if isinstance(exc, SoftTimeLimitExceeded):  # raised by Celery wherever the task was (workers.tasks)
        return JobFailed(
            "time_limit_exceeded",
            f"Training did not finish within the time limit of {settings.CONFIG.job_time_limit_s} seconds, and was "
            f"stopped. Lower n_epochs (it is {job.hyperparameters['n_epochs']}) or train on fewer examples; the "
            "platform's operators can raise the limit (JOB_TIME_LIMIT_SECONDS).",
        )
    if isinstance(exc, DATABASE_ERRORS):  # longer than the wait; if this cannot be written either, the sweeper recovers the job
        log.exception("job %s: the database stayed unreachable", job.pk)
        wait_s = settings.CONFIG.job_database_wait_s
        return JobFailed(
            "database_unavailable",
            f"The database was unreachable for more than {wait_s} s during training; create the job again.",
        )
    if isinstance(exc, StoreUnavailable):
        return JobFailed(
            "storage_unavailable",
            f"The adapter could not be published: the dynamic LoRA path did not answer "
            f"{logged_instead(f'job {job.pk}: the dynamic LoRA path did not answer', str(exc))}. Nothing was "
            "published; create the job again once it answers (operators: check S3_ENDPOINT_URL and the bucket).",
        )
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return JobFailed(
            "storage_full",
            "The platform ran out of disk space while writing this job's checkpoint or adapter. Nothing was "
            "published. Free space (operators: DATA_DIR, FILES_PATH, DYNAMIC_LORA_PATH) and create the job again.",
        )
    log.exception("job %s failed", job.pk)  # a bug or a broken environment: the user still gets a reason
    # The exception's words may tell the tenant what to change; the paths in them are the platform's.
    return JobFailed("training_failed", f"Training failed: {type(exc).__name__}: {scrubbed(str(exc))}")


def drop_training_states(job_id: str) -> None:
    """A finished job's checkpoints keep their adapters (users may fetch them); the training state
    beside each, twice an adapter's size, only ever served a resume."""
    from workers.training.state import TRAINING_STATE_FILE

    store = storage.files()
    for storage_key in Checkpoint.objects.filter(job_id=job_id).values_list("storage_key", flat=True):
        store.delete_prefix(f"{storage_key}/{TRAINING_STATE_FILE}")


def run_job(woken_by: str, worker: str) -> str:
    """Train and publish the job whose turn it is (``finetuning.training_turns.claim_next``: the one the
    message named, or another organization's); returns what happened, for the worker's log."""
    claimed = retrying(training_turns.claim_next, woken_by, worker)
    if claimed is None:
        return f"nothing claimed for {woken_by} (it runs or has finished, or every waiting organization is at its cap)"
    job_id, attempt = claimed.job_id, claimed.attempt
    job = retrying(FineTuningJob.objects.select_related("organization").get, pk=job_id)
    workdir = settings.DATA_DIR / "work" / job.pk / f"attempt-{attempt}"
    with Heartbeat(job_id, attempt, settings.CONFIG.job_heartbeat_s) as heartbeat:
        try:
            callbacks = RewardCallbacks(job, heartbeat) if job.method == REINFORCEMENT else JobCallbacks(job, heartbeat)
            result = _train(job, workdir, callbacks)
            if not result.cancelled:
                _publish(job, heartbeat, result)
        except Exception as exc:
            failure = _explained(exc, job)
            retrying(job_status.fail, job_id, attempt, failure.code, failure.message)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    retrying(training_turns.send_waiting, job.organization_id)  # this job's slot is free: the organization's next one
    status = retrying(job_status.status_of, job_id)
    if status in FINISHED_STATUSES:
        retrying(drop_training_states, job_id)  # no attempt will resume it
        shutil.rmtree(workdir.parent, ignore_errors=True)  # the job's folder, empty of attempts
        return status
    return f"stopped: attempt {attempt} was given up on, and the job queued again"
