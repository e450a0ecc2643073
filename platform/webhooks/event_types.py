"""The events an organization's webhook endpoints can receive: OpenAI's names where OpenAI has the
event, ours in the same style where it has not. Adding one is one line here (then emit it where its
state changes: ``webhooks.emitting.emit``); the API's check, the dashboard's choices and
``docs/api.md`` list these."""

from django.db import models


class EventType(models.TextChoices):
    FINE_TUNING_JOB_SUCCEEDED = "fine_tuning.job.succeeded", "A fine-tuning job succeeded"
    FINE_TUNING_JOB_FAILED = "fine_tuning.job.failed", "A fine-tuning job failed"
    FINE_TUNING_JOB_CANCELLED = "fine_tuning.job.cancelled", "A fine-tuning job was cancelled"
    # Ours: a fine-tuned model answers with a new revision (trained, uploaded or composed).
    MODEL_READY = "model.ready", "A model is published and servable"
    EVAL_RUN_SUCCEEDED = "eval.run.succeeded", "An eval run completed"
    EVAL_RUN_FAILED = "eval.run.failed", "An eval run failed"
    EVAL_RUN_CANCELED = "eval.run.canceled", "An eval run was canceled"
    BATCH_COMPLETED = "batch.completed", "A batch completed"
    BATCH_FAILED = "batch.failed", "A batch failed"
    BATCH_EXPIRED = "batch.expired", "A batch expired before it finished"
    BATCH_CANCELLED = "batch.cancelled", "A batch was cancelled"
