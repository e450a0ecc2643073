"""Revisions of a fine-tuned model: each publish of ``<base>:<suffix>`` is ``<base>:<suffix>@r<N>``,
immutable; the bare name answers with one of them (``FineTunedModel.revision``): the latest
published, or the one a rollback chose.

The dynamic LoRA path holds the revisions and a link to the one the name answers with
(``core.adapter_store``); the pool serves whatever the link says. Both move here, under a lock on
the model's row, so a rollback and a publish at the same moment leave them agreeing.
"""

from __future__ import annotations

from django.conf import settings
from django.db import transaction

from core.adapter_store import AdapterNotFound, AdapterStore
from core.api_errors import ApiError, not_found
from finetuning import storage
from finetuning.models import FineTunedModel, FineTuningJob, ModelRevision, record_event


def _store(model: FineTunedModel | FineTuningJob) -> AdapterStore:
    base_id = model.base_model if isinstance(model, FineTunedModel) else model.model
    base = settings.MODEL_CATALOG.get(base_id)
    if base is None:
        raise ApiError(f"{base_id} is no longer served here, so none of its fine-tunes is.", status=409, code="model_not_available")
    return storage.adapters(base.lora.dynamic_lora_loading_path)


def register(job: FineTuningJob, name: str, final_loss: float | None) -> FineTunedModel:
    """Record the revision ``job`` wrote to the dynamic LoRA path (``write_revision``) and make the
    name answer with it; the model is created with its first revision. Call inside a transaction."""
    model = FineTunedModel.objects.select_for_update().filter(organization_id=job.organization_id, name=name).first()
    if model is None:  # the first revision (or the model was deleted while this revision trained)
        model = FineTunedModel.objects.create(
            name=name, organization=job.organization, job=job, base_model=job.model, suffix=job.suffix,
            final_loss=final_loss, revision=job.revision,
        )  # fmt: skip
        record_event(job, f"New fine-tuned model created: {name}")
    else:
        model.revision = job.revision
        model.save(update_fields=["revision"])
        record_event(job, f"New revision published: {name}@r{job.revision}; {name} answers with it now")
    ModelRevision.objects.create(model=model, number=job.revision, job=job, final_loss=final_loss)
    _store(job).point(name, job.revision)
    return model


def register_first(model: FineTunedModel) -> None:
    """An uploaded or composed model's one revision (``finetuning.adapters`` publishes it)."""
    ModelRevision.objects.create(model=model, number=model.revision)


def roll_back(model: FineTunedModel, number: int) -> FineTunedModel:
    """Make ``model``'s name answer with its revision ``number`` (an earlier one, or back to a later
    one), from the next request on."""
    with transaction.atomic():
        model = FineTunedModel.objects.select_for_update().get(pk=model.pk)
        if not model.revisions.filter(number=number).exists():
            known = ", ".join(f"r{n}" for n in model.revisions.values_list("number", flat=True))
            raise not_found("revision", f"r{number} of {model.name} (it has {known})", param="revision")
        try:
            _store(model).point(model.name, number)
        except AdapterNotFound:
            raise ApiError(
                f"The files of {model.name}@r{number} are no longer in the dynamic LoRA path; it cannot be served.",
                status=409, param="revision", code="revision_unavailable",
            ) from None  # fmt: skip
        model.revision = number
        model.save(update_fields=["revision"])
    return model


def revisions_of(model: FineTunedModel) -> list[ModelRevision]:
    """Newest first, with the jobs that trained them."""
    return list(model.revisions.select_related("job"))
