"""Which models an organization may use: the catalog's base models and its own fine-tuned ones;
and deleting a fine-tuned one.

The inference gateway asks here before it routes a request, so a model that is not listed for the
caller is "not found", whether or not it exists for someone else.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from django.conf import settings
from django.db import transaction

from accounts.models import Organization
from core.model_names import parse_model_name
from finetuning import storage
from finetuning.models import Checkpoint, FineTunedModel

SYSTEM_OWNER = "system"
_EPOCH = datetime(2024, 1, 1, tzinfo=timezone.utc)  # catalog models have no creation date of their own


@dataclass(frozen=True)
class UsableModel:
    name: str  # what clients put in "model"
    base_model_id: str
    suffix: str | None  # None for a base model
    owned_by: str  # "system", or the owning organization's slug
    created_at: datetime
    lineage: dict | None = None  # a fine-tuned model's (``FineTunedModel.lineage``)

    @property
    def parent(self) -> str | None:
        return self.base_model_id if self.suffix else None


def _base(model_id: str) -> UsableModel:
    return UsableModel(model_id, model_id, None, SYSTEM_OWNER, _EPOCH)


def _fine_tuned(model: FineTunedModel, organization: Organization) -> UsableModel:
    return UsableModel(model.name, model.base_model, model.suffix, organization.slug, model.created_at, model.lineage)


def list_usable_models(organization: Organization) -> list[UsableModel]:
    base = [_base(model_id) for model_id in settings.MODEL_CATALOG.ids]
    # with their jobs in the same query: each model's lineage reads its job
    fine_tuned = FineTunedModel.objects.for_org(organization).select_related("job")
    own = [_fine_tuned(model, organization) for model in fine_tuned]
    return base + own


def resolve_model(organization: Organization, name: str) -> UsableModel | None:
    parsed = parse_model_name(name)
    if settings.MODEL_CATALOG.get(parsed.base_model_id) is None:
        return None
    if parsed.suffix is None:
        return _base(parsed.base_model_id)
    model = FineTunedModel.objects.for_org(organization).select_related("job").filter(name=name).first()
    return _fine_tuned(model, organization) if model else None


def delete_fine_tuned_model(model: FineTunedModel) -> None:
    """Take a fine-tuned model out of the registry and the dynamic path.

    Retention: a job's checkpoints (the adapter saved at each epoch end) are kept as long as the model
    the job made, and go with it: deleting the model deletes its adapter, its checkpoints' files and
    their rows. The job itself, its events and its training file stay. (Training states, which only
    served a resume, are dropped as soon as the job finishes.) The inference pool unloads the adapter
    from every replica and drops its cached copies within seconds."""
    # Registry first: from this moment the gateway answers "not found", whatever the stores hold.
    with transaction.atomic():
        if model.job_id is not None:  # an uploaded adapter has no job, and no checkpoints
            Checkpoint.objects.filter(job_id=model.job_id).delete()
        model.delete()
    base = settings.MODEL_CATALOG.get(model.base_model)
    if base is not None:
        storage.adapters(base.lora.dynamic_lora_loading_path).delete(model.name)
    if model.job_id is not None:
        storage.files().delete_prefix(storage.checkpoints_prefix(model.job_id))
