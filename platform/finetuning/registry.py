"""Which models an organization may use: the catalog's base models and its own fine-tuned ones
(with their revisions); and deleting a fine-tuned one.

The inference gateway asks here before it routes a request, so a model that is not listed for the
caller is "not found", whether or not it exists for someone else.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from django.conf import settings
from django.db import transaction

from accounts.models import Organization
from core.model_names import ModelName, parse_model_name
from finetuning import storage
from finetuning.models import Checkpoint, FineTunedModel, FineTuningJob, JobStatus, ModelRevision, parents_of, record_event

SYSTEM_OWNER = "system"
_EPOCH = datetime(2024, 1, 1, tzinfo=timezone.utc)  # catalog models have no creation date of their own


@dataclass(frozen=True)
class UsableModel:
    name: str  # what clients put in "model"
    base_model_id: str
    suffix: str | None  # None for a base model
    owned_by: str  # "system", or the owning organization's slug
    created_at: datetime
    lineage: dict | None = None  # a fine-tuned model's (``FineTunedModel.lineage``), or a checkpoint's
    revision: int | None = None  # a fine-tuned model's: the one its name answers with, or the one pinned

    @property
    def parent(self) -> str | None:
        return self.base_model_id if self.suffix else None

    @property
    def served_as(self) -> str:
        """The name the pool's replicas hold it under: a fine-tuned model's pinned to its revision."""
        return str(ModelName(self.base_model_id, self.suffix, self.revision)) if self.revision else self.name


def _base(model_id: str) -> UsableModel:
    return UsableModel(model_id, model_id, None, SYSTEM_OWNER, _EPOCH)


def _fine_tuned(
    model: FineTunedModel, organization: Organization, pinned: int | None = None, lineage: dict | None = None
) -> UsableModel:
    name = str(ModelName(model.base_model, model.suffix, pinned))
    lineage = lineage if lineage is not None else model.lineage
    return UsableModel(name, model.base_model, model.suffix, organization.slug, model.created_at, lineage, pinned or model.revision)


def _checkpoint(checkpoint: Checkpoint, organization: Organization) -> UsableModel:
    job = checkpoint.job
    lineage = {"origin": "checkpoint", "job": job.id, "step": checkpoint.step_number, "epoch": checkpoint.epoch}
    return UsableModel(checkpoint.name, job.model, job.suffix, organization.slug, checkpoint.created_at, lineage)


def list_usable_models(organization: Organization) -> list[UsableModel]:
    base = [_base(model_id) for model_id in settings.MODEL_CATALOG.ids]
    # With their jobs in the same query: each model's lineage reads its job, and its ancestors are
    # read from all of them (no query per model).
    fine_tuned = list(FineTunedModel.objects.for_org(organization).select_related("job"))
    parents = parents_of(organization)
    own = [_fine_tuned(model, organization, lineage=model.lineage_among(parents)) for model in fine_tuned]
    return base + own


def resolve_model(organization: Organization, name: str) -> UsableModel | None:
    """The model ``name`` names, if the organization may use it: a base model, a fine-tuned one (at
    its current revision, or pinned to one with ``@r<N>``), or a checkpoint of one of its jobs."""
    parsed = parse_model_name(name)
    if settings.MODEL_CATALOG.get(parsed.base_model_id) is None:
        return None
    if parsed.suffix is None:
        return _base(parsed.base_model_id)
    if parsed.checkpoint_step is not None:
        checkpoint = checkpoint_named(organization, parsed)
        return _checkpoint(checkpoint, organization) if checkpoint else None
    model = FineTunedModel.objects.for_org(organization).select_related("job").filter(name=parsed.model).first()
    if model is None or (parsed.revision is not None and not model.revisions.filter(number=parsed.revision).exists()):
        return None
    return _fine_tuned(model, organization, parsed.revision)


def checkpoint_named(organization: Organization, name: ModelName) -> Checkpoint | None:
    """The organization's checkpoint ``name`` names (``<model>[@r<N>]:ckpt-step-<M>``), with its job."""
    assert name.checkpoint_step is not None
    return (
        Checkpoint.objects.filter(
            job__organization=organization, job__model=name.base_model_id, job__suffix=name.suffix,
            job__revision=name.revision or 1, step_number=name.checkpoint_step,
        ).select_related("job").first()
    )


def revisions_of(model: FineTunedModel) -> list[ModelRevision]:
    """Newest first, with the jobs that trained them."""
    return list(model.revisions.select_related("job"))


def delete_fine_tuned_model(model: FineTunedModel) -> None:
    """Take a fine-tuned model out of the registry and the dynamic path: every revision of it.

    Retention: the checkpoints of the jobs that trained its revisions (the adapter saved at each
    epoch end, servable under its name) are kept as long as the model, and go with it: deleting the
    model deletes its adapters, its checkpoints' files and their rows. The jobs themselves, their
    events and their training files stay. (Training states, which only served a resume, are dropped
    as soon as a job finishes.) The inference pool and Ray Serve's replicas unload them and drop
    their cached copies within seconds."""
    job_ids = {job_id for job_id in model.revisions.values_list("job_id", flat=True) if job_id} | (
        {model.job_id} if model.job_id else set()
    )  # an uploaded or composed model has no job, and no checkpoints
    checkpoints = list(Checkpoint.objects.filter(job_id__in=job_ids).select_related("job"))
    # Registry first: from this moment the gateway answers "not found", whatever the stores hold.
    with transaction.atomic():
        Checkpoint.objects.filter(pk__in=[checkpoint.pk for checkpoint in checkpoints]).delete()
        model.delete()
    _delete_stored(model.base_model, [model.name, *{checkpoint.name for checkpoint in checkpoints}], job_ids)


def expire_unpublished_checkpoints(now: datetime) -> list[str]:
    """Retention for jobs that published nothing (failed or cancelled): their checkpoints stay
    servable and downloadable for ``UNPUBLISHED_CHECKPOINTS_DAYS`` after the job ended, then go
    (rows, adapters, files). The ids of the jobs whose checkpoints went."""
    days = settings.CONFIG.unpublished_checkpoints_days
    ended = FineTuningJob.objects.filter(
        status__in=(JobStatus.FAILED, JobStatus.CANCELLED), finished_at__lt=now - timedelta(days=days)
    )
    expired = []
    for job in ended.filter(checkpoints__isnull=False).distinct():
        checkpoints = list(job.checkpoints.select_related("job"))
        Checkpoint.objects.filter(pk__in=[checkpoint.pk for checkpoint in checkpoints]).delete()
        _delete_stored(job.model, [checkpoint.name for checkpoint in checkpoints], {job.pk})
        record_event(job, f"Deleted its {len(checkpoints)} checkpoint(s): the job ended without publishing a "
                          f"model more than {days} day(s) ago (UNPUBLISHED_CHECKPOINTS_DAYS).")
        expired.append(job.pk)
    return expired


def _delete_stored(base_model: str, adapter_names: list[str], job_ids: set[str]) -> None:
    """The adapters under these names, and the jobs' checkpoint files; the registry rows are gone already."""
    base = settings.MODEL_CATALOG.get(base_model)
    if base is not None:
        adapters = storage.adapters(base)
        for name in adapter_names:
            adapters.delete(name)
    for job_id in job_ids:
        storage.files().delete_prefix(storage.checkpoints_prefix(job_id))
