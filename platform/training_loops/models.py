"""Training loops in the caller's hands (Thinking Machines' Tinker protocol): a session of one
organization, the training runs in it (each one LoRA held by a trainer process with its optimizer
state, driven step by step), and what a run saved.

A run's trainer is leased like a job's: it beats (``heartbeat_at``) while it holds the run; a run
whose beat went silent lost its trainer, and is failed with the path of its last saved state, from
which the caller starts again (``create_training_client_from_state``). Nothing is lost silently.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from functools import partial

from django.db import models

from accounts.models import Organization
from base.records import OrgQuerySet, new_id
from core.model_names import ModelName


SESSION_SILENT_S = 60  # the SDK beats every 10 s while its process lives


class LoopSession(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=partial(new_id, "session", "_"), editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="loop_sessions")
    display_name = models.CharField(max_length=200, blank=True, default="")
    tags = models.JSONField(default=list)
    user_metadata = models.JSONField(null=True, blank=True)
    sdk_version = models.CharField(max_length=40, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    heartbeat_at = models.DateTimeField(auto_now_add=True)  # the client's: it stops when the client does
    finished_at = models.DateTimeField(null=True, blank=True)  # the client closed it: its runs stop

    objects = OrgQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]

    def is_gone(self, now: datetime) -> bool:
        """Closed by its client, or its client silent for SESSION_SILENT_S: nobody will send its runs more work."""
        return self.finished_at is not None or now - self.heartbeat_at > timedelta(seconds=SESSION_SILENT_S)


class RunStatus(models.TextChoices):
    QUEUED = "queued"  # waiting for a trainer
    RUNNING = "running"  # a trainer holds its weights and optimizer
    STOPPED = "stopped"  # idle past LOOP_IDLE_SECONDS, or its session ended: its saved states remain
    FAILED = "failed"  # its trainer was lost, or could not start it (error_message says which)


class LoopRun(models.Model):
    """A Tinker "training run" (its ``model_id``): one LoRA on one base model. Its id is
    ``<session>:train:<n>``, the n-th model its client made in the session: the SDK derives it
    too (a run created from a saved state is named before the server answers)."""

    id = models.CharField(primary_key=True, max_length=80, editable=False)
    session = models.ForeignKey(LoopSession, on_delete=models.CASCADE, related_name="runs")
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="loop_runs")
    base_model = models.CharField(max_length=200)  # a base model id from the catalog
    lora_rank = models.IntegerField()
    seed = models.BigIntegerField(null=True, blank=True)
    train_mlp = models.BooleanField(default=True)
    train_attn = models.BooleanField(default=True)
    user_metadata = models.JSONField(null=True, blank=True)
    # A saved state (``LoopCheckpoint``) the trainer loads before its first request: a run created
    # from a state (``load_weights`` as its first request).
    start_from = models.ForeignKey("LoopCheckpoint", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    start_with_optimizer = models.BooleanField(default=False)
    status = models.CharField(max_length=20, choices=RunStatus.choices, default=RunStatus.QUEUED)
    error_message = models.TextField(blank=True, default="")
    worker = models.CharField(max_length=200, blank=True, default="")
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # Sampler weights saved so far: the k-th is served as revision k of ``served_model``.
    sampler_saves = models.IntegerField(default=0)
    steps = models.IntegerField(default=0)  # optimizer steps taken

    objects = OrgQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]

    @property
    def served_model(self) -> ModelName:
        """The name its sampler weights are served under by the pool, one revision per save (an
        immutable name each: a replica never answers with weights older than the name says)."""
        session, _, number = self.id.partition(":train:")
        return ModelName(self.base_model, f"tinker-{session.removeprefix('session_')}-{number}")


class CheckpointKind(models.TextChoices):
    STATE = "training"  # weights and optimizer: a run goes on from it (``save_state``)
    SAMPLER = "sampler"  # weights only, served at once (``save_weights_for_sampler``)


class LoopCheckpoint(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=partial(new_id, "ckpt", "_"), editable=False)
    run = models.ForeignKey(LoopRun, on_delete=models.CASCADE, related_name="checkpoints")
    kind = models.CharField(max_length=16, choices=CheckpointKind.choices)
    name = models.CharField(max_length=128)  # the caller's, or the step's
    storage_key = models.CharField(max_length=255, blank=True, default="")  # a state's folder in the file store
    revision = models.IntegerField(null=True, blank=True)  # a sampler save's revision of the run's served model
    size_bytes = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [models.UniqueConstraint(fields=["run", "kind", "name"], name="one_loop_checkpoint_per_name")]

    @property
    def checkpoint_id(self) -> str:
        """``weights/<name>`` or ``sampler_weights/<name>``: its id within its run, as the SDK names it."""
        folder = "weights" if self.kind == CheckpointKind.STATE else "sampler_weights"
        return f"{folder}/{self.name}"

    @property
    def path(self) -> str:
        """Its ``tinker://`` path, as the SDK names saved weights."""
        return f"tinker://{self.run_id}/{self.checkpoint_id}"

    @property
    def served_as(self) -> str | None:
        """A sampler save's served name (``<base>:tinker-<run>@r<k>``)."""
        if self.revision is None:
            return None
        name = self.run.served_model
        return str(ModelName(name.base_model_id, name.suffix, self.revision))
