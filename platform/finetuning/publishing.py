"""Publishing: how an adapter comes to answer under a name, whichever way it was made (a job's
checkpoint, a job's trained revision, an uploaded adapter, a composed one), and what a fine-tuned
model's name answers with afterwards (a rollback).

Each publish of ``<base>:<suffix>`` is a revision, ``<base>:<suffix>@r<N>``, immutable; the bare
name answers with one of them (``FineTunedModel.revision``): the latest published, or the one a
rollback chose. The base model's dynamic LoRA path (``store_for``) holds the revisions and a link to
the one the name answers with (``core.adapter_store``); the pool serves whatever the link says. The
row and the link move together under a lock on the model's row (``_answer_with``), so a rollback
and a publish at the same moment leave them agreeing.

The kinds of publish share their steps (the files, the rows, the link; for a trained revision the
pool's preload and the job's events too), each kind in the order its own guarantee needs:
- a job's checkpoint (``publish_checkpoint``): servable under its own name while the job trains on;
- a trained revision: its files first, pinned and not yet under the name
  (``write_trained_revision``: the evaluation gate asks the pool for them), then, in the transaction
  that makes the job succeed, the rows and the link (``publish_trained_revision``: the registry never
  names files that are not there), then the pool loads it (``announce_ready``); a revision that is
  not to be published goes (``withdraw_trained_revision``);
- a new model, uploaded (``publish_upload``) or composed (``publish_composition``): its row first,
  so that of two publishes under one name only one writes (the unique name decides), then the files
  and the link; nothing stays registered if the store fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, transaction

from accounts.models import Organization
from core.adapter_archive import ADAPTER_FILES
from core.adapter_check import served_config
from core.adapter_store import AdapterNotFound, AdapterStore, StoreUnavailable
from core.api_errors import ApiError, adapter_store_unreachable, logged_instead, not_found, suffix_taken
from core.model_names import ModelName
from finetuning import quotas, storage
from finetuning.models import Checkpoint, Composition, FineTunedModel, FineTuningJob, ModelRevision, record_event
from base.serving_client import PoolUnavailable, preload
from webhooks.emitting import emit
from webhooks.event_types import EventType


def store_for(base_model_id: str) -> AdapterStore:
    """Where the fine-tunes of catalog model ``base_model_id`` are published. A base model gone from
    the catalog serves none of them (a 409)."""
    base = settings.MODEL_CATALOG.get(base_model_id)
    if base is None:
        raise ApiError(
            f"{base_model_id} is no longer served here, so none of its fine-tunes is.", status=409, code="model_not_available"
        )
    return storage.adapters(base)


def publish_checkpoint(checkpoint: Checkpoint, adapter_dir: Path) -> None:
    """A job's checkpoint (not yet saved), servable under its own name from now on while the job
    trains on (its one revision: r1), then recorded. Safe to call again after a database error: the
    files are written again, the row saved again."""
    store_for(checkpoint.job.model).publish(checkpoint.name, adapter_dir, revision=1)
    checkpoint.save()
    if checkpoint.metrics.get("ends_epoch", True):
        when = f"after epoch {checkpoint.epoch} (step {checkpoint.step_number})"
    else:
        when = f"at step {checkpoint.step_number} (within epoch {checkpoint.epoch})"
    record_event(checkpoint.job, f"Checkpoint saved {when}: {checkpoint.name}")


def _trained_revision(job: FineTuningJob) -> str:
    """The pinned name of the revision ``job`` publishes: ``<base>:<suffix>@r<N>``."""
    return str(ModelName(job.model, job.suffix, job.revision))


def write_trained_revision(job: FineTuningJob, adapter_dir: Path) -> str:
    """Write the revision ``job`` trained, servable by its pinned name (returned); the bare name does
    not move until ``publish_trained_revision``."""
    store_for(job.model).write_revision(str(ModelName(job.model, job.suffix)), job.revision, adapter_dir)
    return _trained_revision(job)


def withdraw_trained_revision(job: FineTuningJob) -> None:
    """Delete the revision ``job`` wrote and will not publish (it failed its evaluation, or the job
    was cancelled meanwhile): nothing answers with it."""
    store_for(job.model).delete(_trained_revision(job))


def publish_trained_revision(job: FineTuningJob, name: str, final_loss: float | None) -> FineTunedModel:
    """Record the revision ``job`` wrote (``write_trained_revision``) and make the name answer with
    it; the model is created with its first revision. Call inside the transaction that makes the job
    succeed."""
    model = FineTunedModel.objects.select_for_update().filter(organization_id=job.organization_id, name=name).first()
    if model is None:  # the first revision (or the model was deleted while this revision trained)
        model = FineTunedModel.objects.create(
            name=name, organization=job.organization, job=job, base_model=job.model, suffix=job.suffix,
            final_loss=final_loss, revision=job.revision,
        )
        record_event(job, f"New fine-tuned model created: {name}")
    else:
        record_event(job, f"New revision published: {name}@r{job.revision}; {name} answers with it now")
    ModelRevision.objects.create(model=model, number=job.revision, job=job, final_loss=final_loss)
    _answer_with(model, job.revision)
    _emit_ready(model, job.revision)
    return model


def _emit_ready(model: FineTunedModel, number: int) -> None:
    """The webhook event of a name that answers with a new revision (sent once the publish commits)."""
    emit(model.organization_id, EventType.MODEL_READY, {"id": model.name, "revision": f"{model.name}@r{number}"})


def announce_ready(job: FineTuningJob, name: str) -> None:
    """Have the pool load the just-published ``name`` where its requests will go, so its first
    request finds it loaded, and say so in the job's events. Safe to call again after a database
    error: the pool finds it loaded already."""
    try:
        replicas = preload(name)
    except PoolUnavailable as exc:  # published all the same: it loads on its first request
        # The event is the tenant's to read: the pool's address stays in the worker's log.
        why = logged_instead(f"the inference pool did not preload {name}", str(exc))
        record_event(job, f"{name} loads on its first request (the inference pool did not preload it {why})")
        return
    record_event(job, f"Ready on {replicas} replica(s): {name} answers its first request with no load")


@dataclass(frozen=True)
class _NewModel:
    """What makes an uploaded model and a composed one differ as they are published."""

    what: str  # the adapter, as a quota refusal names it
    param: str  # the request's field a quota refusal points at
    composition: dict | None = None  # a composed model's lineage
    held_by: str | None = None  # the composition that holds the name while a worker builds it


def publish_upload(organization: Organization, name: ModelName, folder: Path) -> FineTunedModel:
    """Register and publish an uploaded adapter (checked already: ``finetuning.adapters``) as ``name``."""
    return _publish_new_model(organization, name, folder, _NewModel("this adapter", "file"))


def publish_composition(
    organization: Organization, name: ModelName, folder: Path, lineage: dict, held_by: str | None = None
) -> FineTunedModel:
    """Register and publish a composed adapter (checked already: ``finetuning.compose``) as ``name``,
    with its ``lineage``; ``held_by`` the id of the composition that holds the name when it was built
    on a worker."""
    return _publish_new_model(organization, name, folder, _NewModel("the composed model", "parents", lineage, held_by))


def publish_saved_weights(organization: Organization, name: ModelName, folder: Path, lineage: dict) -> FineTunedModel:
    """Register and publish weights a training loop saved for sampling (``training_loops``) as ``name``."""
    return _publish_new_model(organization, name, folder, _NewModel("these weights", "suffix", lineage))


def _publish_new_model(organization: Organization, name: ModelName, folder: Path, new: _NewModel) -> FineTunedModel:
    """The adapter in ``folder`` as the new model ``name``: its size counts against the
    organization's storage quota. Nothing stays registered if publishing fails."""
    served_config(folder, name.base_model_id)
    size = sum((folder / file).stat().st_size for file in ADAPTER_FILES)
    quotas.check_storage(organization, size, what=new.what, param=new.param)
    model = _register(organization, name, size, new)
    try:
        store_for(model.base_model).publish(model.name, folder, model.revision)
    except BaseException as exc:
        model.delete()  # the name is free again; nothing was published
        if isinstance(exc, StoreUnavailable):
            raise adapter_store_unreachable(model.name, str(exc)) from None
        raise
    _emit_ready(model, model.revision)
    return model


def check_suffix_free(name: ModelName, held_by: str | None = None) -> None:
    """The suffix names one adapter for everyone: no model has it, no job trains it, and no
    composition under way builds it (a job and a composition hold their suffix from creation, as
    they will publish under it), but for ``held_by``, the composition publishing it now."""
    compositions = Composition.objects.unfinished().filter(model=str(name)).exclude(pk=held_by)
    if (
        FineTunedModel.objects.filter(name=str(name)).exists()
        or FineTuningJob.objects.filter(model=name.base_model_id, suffix=name.suffix).exists()
        or compositions.exists()
    ):
        raise suffix_taken(str(name))


def _register(organization: Organization, name: ModelName, size: int, new: _NewModel) -> FineTunedModel:
    """The registry row before the adapter is published, so that of two uploads under one name only
    one publishes (the unique name decides). Until it is published a request for it is a 404."""
    assert name.suffix is not None  # a fine-tuned model's name (job_creation.chosen_suffix)
    try:
        with transaction.atomic():
            quotas.check_storage(organization, size, locked=True, what=new.what, param=new.param)
            check_suffix_free(name, new.held_by)
            model = FineTunedModel.objects.create(
                name=str(name), organization=organization, job=None, base_model=name.base_model_id,
                suffix=name.suffix, uploaded_bytes=size, composition=new.composition,
            )
            ModelRevision.objects.create(model=model, number=model.revision)  # its one revision
            return model
    except IntegrityError:
        raise suffix_taken(str(name)) from None


def roll_back(model: FineTunedModel, number: int) -> FineTunedModel:
    """Make ``model``'s name answer with its revision ``number`` (an earlier one, or back to a later
    one), from the next request on."""
    with transaction.atomic():
        model = FineTunedModel.objects.select_for_update().get(pk=model.pk)
        if not model.revisions.filter(number=number).exists():
            known = ", ".join(f"r{n}" for n in model.revisions.values_list("number", flat=True))
            raise not_found("revision", f"r{number} of {model.name} (it has {known})", param="revision")
        try:
            _answer_with(model, number)
        except AdapterNotFound:
            raise ApiError(
                f"The files of {model.name}@r{number} are no longer in the dynamic LoRA path; it cannot be served.",
                status=409, param="revision", code="revision_unavailable",
            ) from None
    return model


def _answer_with(model: FineTunedModel, number: int) -> None:
    """Make the name answer with its published revision ``number``: the row, then the link (last,
    so a database write that fails has moved nothing). The caller holds the row's lock, in a
    transaction."""
    if model.revision != number:
        model.revision = number
        model.save(update_fields=["revision"])
    store_for(model.base_model).point(model.name, number)
