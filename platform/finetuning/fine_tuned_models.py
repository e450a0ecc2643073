"""Fine-tuned models after their job: deleting one takes it out of the registry and the dynamic path.

Retention: a job's checkpoints (the adapter saved at each epoch end) are kept as long as the model
the job made, and go with it: deleting the model deletes its adapter, its checkpoints' files and
their rows. The job itself, its events and its training file stay. (Training states, which only
served a resume, are dropped as soon as the job finishes.) The inference pool unloads the adapter
from every replica and drops its cached copies within seconds.
"""

from __future__ import annotations

from django.conf import settings
from django.db import transaction

from finetuning import storage
from finetuning.models import Checkpoint, FineTunedModel


def delete_fine_tuned_model(model: FineTunedModel) -> None:
    # Registry first: from this moment the gateway answers "not found", whatever the stores hold.
    with transaction.atomic():
        Checkpoint.objects.filter(job_id=model.job_id).delete()
        model.delete()
    base = settings.MODEL_CATALOG.get(model.base_model)
    if base is not None:
        storage.adapters(base.lora.dynamic_lora_loading_path).delete(model.name)
    storage.files().delete_prefix(storage.checkpoints_prefix(model.job_id))
