"""Token counts with a base model's own tokenizer and chat template (the trainer's counting)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from django.conf import settings

from core.catalog import BaseModel
from core.datasets import Example


def default_model() -> BaseModel:
    """Uploads are counted and checked with the catalog's first model: no job names one yet."""
    return settings.MODEL_CATALOG.models[0]


@functools.lru_cache(maxsize=None)
def _tokenizer(model_id: str):
    from transformers import AutoTokenizer  # deferred: a second or two to import

    return AutoTokenizer.from_pretrained(settings.MODEL_CATALOG.get(model_id).weights)


def token_counter(model: BaseModel) -> Callable[[Example], int]:
    from workers.training import example_token_count

    tokenizer = _tokenizer(model.id)
    return lambda example: example_token_count(tokenizer, example)
