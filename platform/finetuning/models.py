"""Training files, fine-tuning jobs with their events and checkpoints, and the models they make.

Everything belongs to an organization; queries go through ``for_org`` so another organization's
rows are invisible (they answer 404, as if they did not exist).
"""

from __future__ import annotations

from functools import partial
from typing import Self

from django.conf import settings
from django.db import models

from accounts.models import Organization
from base.records import OrgQuerySet, new_id
from core.model_names import ModelName, parse_model_name, with_revision


class File(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=partial(new_id, "file"), editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="files")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    filename = models.CharField(max_length=255)
    purpose = models.CharField(max_length=32, default="fine-tune")
    bytes = models.BigIntegerField()
    storage_key = models.CharField(max_length=255)  # where the bytes are in object storage
    example_count = models.IntegerField()
    # With the default base model's tokenizer and chat template; a batch file's: its prompts, estimated.
    token_count = models.BigIntegerField()
    max_example_tokens = models.IntegerField()  # checked against a job's model context at launch
    # What its lines hold (``core.datasets``): "chat" (chat or prompt/completion lines) or "preference"
    # (DPO pairs); a job's method needs one of them.
    format = models.CharField(max_length=16, default="chat")
    created_at = models.DateTimeField(auto_now_add=True)

    objects = OrgQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]


class JobStatus(models.TextChoices):
    # No "validating_files": a job's files are checked before it is created (``finetuning.job_creation``).
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


FINISHED_STATUSES = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)

# OpenAI's fine-tuning method types offered here (``FineTuningJob.method``).
SUPERVISED, DPO, REINFORCEMENT = "supervised", "dpo", "reinforcement"
METHODS = (SUPERVISED, DPO, REINFORCEMENT)


class FineTuningJob(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=partial(new_id, "ftjob"), editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="jobs")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    model = models.CharField(max_length=200)  # a base model id from the catalog
    # A continued fine-tune's starting point as the caller named it in "model": one of the
    # organization's fine-tuned models (<model>:<its suffix>), a revision of one (...@r<N>) or a
    # checkpoint (...:ckpt-step-<N>); None when training starts from the base model alone.
    parent_model = models.CharField(max_length=300, null=True, blank=True)
    # The revision a bare parent name answered with when the job was created: the job trains on from
    # exactly that one (``exact_parent``). None for a name that is exact already, and for jobs of old.
    parent_revision = models.IntegerField(null=True, blank=True)
    # The revision of <model>:<suffix> the job publishes: 1 for a new suffix; the next one when it
    # continues the model of its own suffix (``finetuning.job_creation.create_job`` reserves it).
    revision = models.IntegerField(default=1)
    # Ids, not foreign keys: a job keeps naming its files after they are deleted (as OpenAI's do).
    training_file = models.CharField(max_length=40)
    validation_file = models.CharField(max_length=40, null=True, blank=True)
    suffix = models.CharField(max_length=64)
    seed = models.IntegerField()
    # OpenAI's method type: "supervised" (chat files), "dpo" (preference files; beta in hyperparameters) or
    # "reinforcement" (prompts files, scored by ``grader``).
    method = models.CharField(max_length=16, default=SUPERVISED)
    grader = models.JSONField(null=True, blank=True)  # reinforcement: the grader of each sample, as checked
    hyperparameters = models.JSONField()  # resolved values: no "auto" left once the job is created
    metadata = models.JSONField(null=True, blank=True)
    # A gate on publishing: {"file", "graders", "threshold"}, and once scored {"scores": ...}
    # (``workers.evaluation``). None: the adapter is published when training ends.
    evaluation = models.JSONField(null=True, blank=True)
    status = models.CharField(max_length=20, choices=JobStatus.choices, default=JobStatus.QUEUED)
    fine_tuned_model = models.CharField(max_length=300, null=True, blank=True)
    trained_tokens = models.BigIntegerField(null=True, blank=True)
    error_code = models.CharField(max_length=64, blank=True, default="")
    error_message = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    estimated_finish = models.DateTimeField(null=True, blank=True)
    # Which worker runs the job, and when it last said so: a stale heartbeat means it died.
    worker = models.CharField(max_length=200, blank=True, default="")
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    attempts = models.IntegerField(default=0)
    # When the job last entered the queue (created, re-queued, or its lost message sent again):
    # its place in line, and how long its message may take before the sweeper sends it again.
    queued_at = models.DateTimeField(null=True, blank=True)
    # The id of the File (purpose "fine-tune-results") with the per-step metrics as CSV, written
    # when the job succeeds: its "result_files", as OpenAI's jobs have.
    result_file = models.CharField(max_length=40, null=True, blank=True)
    # With early stopping, the step whose adapter the job published (the best validation loss), once
    # it has succeeded; None otherwise: the last step's.
    best_step = models.IntegerField(null=True, blank=True)

    objects = OrgQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            # The adapter's path and served name are <model>:<suffix>@r<revision>, shared by all organizations.
            models.UniqueConstraint(fields=["model", "suffix", "revision"], name="one_job_per_model_revision"),
        ]

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    @property
    def exact_parent(self) -> str | None:
        """The adapter a continued fine-tune trains on from, by a name that never changes what it
        names: a revision (``<model>@r<N>``) or a checkpoint. (A job of old recorded the bare name.)"""
        if self.parent_model is None or self.parent_revision is None:
            return self.parent_model
        return with_revision(self.parent_model, self.parent_revision)


class JobEvent(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=partial(new_id, "ftevent"), editable=False)
    job = models.ForeignKey(FineTuningJob, on_delete=models.CASCADE, related_name="events")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    level = models.CharField(max_length=10, default="info")
    type = models.CharField(max_length=10, default="message")  # "message" or "metrics"
    message = models.TextField()
    data = models.JSONField(null=True, blank=True)  # metrics: step, train_loss, tokens_per_second, ...

    class Meta:
        ordering = ["-created_at", "-pk"]


class Checkpoint(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=partial(new_id, "ftckpt"), editable=False)
    job = models.ForeignKey(FineTuningJob, on_delete=models.CASCADE, related_name="checkpoints")
    step_number = models.IntegerField()
    epoch = models.IntegerField()
    metrics = models.JSONField()
    storage_key = models.CharField(max_length=255)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-step_number"]

    @property
    def name(self) -> str:
        """``<base>:<suffix>:ckpt-step-<N>`` (``<suffix>@r<N>:...`` for a later revision's job): the
        name it is served and downloaded under."""
        job = self.job
        revision = job.revision if job.revision > 1 else None  # a first revision's checkpoints keep the short name
        return str(ModelName(job.model, job.suffix, revision, self.step_number))


class FineTunedModel(models.Model):
    """A published adapter: served as ``name`` to its organization until deleted. Trained by a job,
    uploaded (``job`` None: trained elsewhere, ``finetuning.adapters``), or composed of others
    (``composition`` set: ``finetuning.compose``)."""

    name = models.CharField(max_length=300, unique=True)  # <base_model_id>:<suffix>
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="fine_tuned_models")
    job = models.OneToOneField(FineTuningJob, null=True, blank=True, on_delete=models.CASCADE, related_name="result")
    base_model = models.CharField(max_length=200)
    suffix = models.CharField(max_length=64)
    final_loss = models.FloatField(null=True, blank=True)  # the last training loss, for lineage pages
    # An uploaded or composed adapter's size, counted against its organization's storage quota like its files.
    uploaded_bytes = models.BigIntegerField(default=0)
    # A composed model's lineage: {"parents": [{"model", "scale"}], "method", "rank", "approximation_error", ...}
    composition = models.JSONField(null=True, blank=True)
    # The revision the bare name answers with: the latest published, or the one rolled back to
    # (``finetuning.publishing``; the dynamic LoRA path's link says the same, for the pool).
    revision = models.IntegerField(default=1)
    created_at = models.DateTimeField(auto_now_add=True)

    objects = OrgQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    @property
    def lineage(self) -> dict:
        """Where the adapter came from, as ``/v1/models`` and the models page show it."""
        return self.lineage_among(None)

    def lineage_among(self, parents: Parents | None) -> dict:
        """``lineage``, with the chain of parents read from ``parents`` (``Parents``: each of the
        organization's published revisions, with the exact parent its job trained on from) instead
        of a query per ancestor: a listing of many models reads them all at once."""
        if self.composition is not None:
            return {"origin": "composed", **self.composition}
        if self.job_id is not None:
            lineage: dict = {"origin": "trained", "job": self.job_id}
            parent = self.job.exact_parent if self.job else None
            if parent:
                lineage |= {"parent": parent, "ancestors": self.ancestors(parent, parents)}
            return lineage
        return {"origin": "uploaded"}

    def ancestors(self, parent: str, parents: Parents | None = None) -> list[str]:
        """The chain of adapters this one was continued from, nearest first, each by its exact name
        (a revision or a checkpoint): the job that made each names the next. It stops at one whose
        model was deleted (named, but its own parents are no longer known), that was not trained, or
        that is a checkpoint of a job that published nothing."""
        chain: list[str] = []
        name: str | None = parent
        while name and name not in chain:
            chain.append(name)
            made_by = revision_making(name)
            if parents is not None:
                name = parents.get(made_by)
                continue
            model_name, number = made_by
            revision = (
                ModelRevision.objects.filter(model__organization_id=self.organization_id, model__name=model_name, number=number)
                .select_related("job").first()
            )
            name = revision.job.exact_parent if revision and revision.job else None
        return chain


# Each published revision of an organization's models, as (model name, revision number), with the
# exact parent its job trained on from (None: trained from the base model, uploaded or composed).
Parents = dict[tuple[str, int], str | None]


def revision_making(name: str) -> tuple[str, int]:
    """The revision whose job made the adapter ``name``: a revision itself, or the revision a
    checkpoint's job published; a bare name (as jobs of old recorded their parent) is taken for the
    first revision, whose job made the model."""
    parsed = parse_model_name(name)
    return parsed.model, parsed.revision or 1


def parents_of(organization: Organization) -> Parents:
    """``Parents`` for every revision of the organization's models, in one query."""
    revisions = ModelRevision.objects.filter(model__organization=organization).select_related("model", "job")
    return {(r.model.name, r.number): r.job.exact_parent if r.job else None for r in revisions}


class ModelRevision(models.Model):
    """One publish of a fine-tuned model: ``<name>@r<number>``, immutable once published."""

    model = models.ForeignKey(FineTunedModel, on_delete=models.CASCADE, related_name="revisions")
    number = models.IntegerField()
    job = models.OneToOneField(FineTuningJob, null=True, blank=True, on_delete=models.SET_NULL, related_name="published_revision")
    final_loss = models.FloatField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-number"]
        constraints = [models.UniqueConstraint(fields=["model", "number"], name="one_row_per_revision")]


class CompositionStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


UNFINISHED_COMPOSITION_STATUSES = (CompositionStatus.QUEUED, CompositionStatus.RUNNING)


class CompositionQuerySet(OrgQuerySet):
    def unfinished(self) -> Self:
        return self.filter(status__in=UNFINISHED_COMPOSITION_STATUSES)


class Composition(models.Model):
    """A composed model built on a worker (``finetuning.compositions``): every method but ``linear``,
    which is cheap enough to build in the request. Everything it needs was checked when it was
    created; the worker re-reads its parents by name, and publishes ``model`` or fails with a reason."""

    id = models.CharField(primary_key=True, max_length=40, default=partial(new_id, "ftcomp"), editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="compositions")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    # The fine-tuned model it publishes, <base_model_id>:<suffix>: held for it from creation
    # (``finetuning.publishing.check_suffix_free``) until it has finished.
    model = models.CharField(max_length=300)
    parents = models.JSONField()  # [{"model", "scale"}], in the order they were given
    method = models.CharField(max_length=20)
    rank = models.IntegerField()  # the result's, resolved at creation
    density = models.FloatField()
    seed = models.IntegerField()
    # The result's size at most (from its rank and the base model's layers), checked against the
    # organization's storage quota before it was queued; its real size is checked again on publishing.
    estimated_bytes = models.BigIntegerField()
    status = models.CharField(max_length=20, choices=CompositionStatus.choices, default=CompositionStatus.QUEUED)
    error_code = models.CharField(max_length=64, blank=True, default="")
    error_message = models.TextField(blank=True, default="")
    approximation_error = models.FloatField(null=True, blank=True)  # once it has succeeded
    worker = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = CompositionQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]

    @property
    def is_finished(self) -> bool:
        return self.status not in UNFINISHED_COMPOSITION_STATUSES


def record_event(job: FineTuningJob, message: str, *, level: str = "info", data: dict | None = None) -> JobEvent:
    """What happened to a job, as the user reads it: a message, or (with ``data``) training metrics."""
    return JobEvent.objects.create(job=job, message=message, level=level, type="metrics" if data else "message", data=data)
