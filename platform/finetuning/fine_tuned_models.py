"""Fine-tuned models after their job: deleting one takes it out of the registry and the dynamic path."""

from __future__ import annotations

from django.conf import settings

from finetuning import storage
from finetuning.models import FineTunedModel


def delete_fine_tuned_model(model: FineTunedModel) -> None:
    # Registry first: from this moment the gateway answers "not found", whatever the store holds.
    model.delete()
    base = settings.MODEL_CATALOG.get(model.base_model)
    if base is not None:
        storage.adapters(base.lora.dynamic_lora_loading_path).delete(model.name)
