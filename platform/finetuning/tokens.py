"""Token counts with a base model's own tokenizer and chat template (the trainer's counting).

Uploads are checked in the web process: ``core.chat_tokens`` tokenizes without torch, which the web
process never loads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from django.conf import settings

from core.catalog import BaseModel
from core.chat_tokens import example_token_count, load_tokenizer
from core.datasets import Example

if TYPE_CHECKING:  # importing transformers costs seconds: only the type checker reads it here
    from transformers import PreTrainedTokenizerBase


def default_model() -> BaseModel:
    """Uploads are counted and checked with the catalog's first model: no job names one yet."""
    return settings.MODEL_CATALOG.models[0]


@functools.lru_cache(maxsize=None)
def _tokenizer(model_id: str) -> PreTrainedTokenizerBase:
    return load_tokenizer(settings.MODEL_CATALOG.require(model_id).weights)  # a second or two, once


def token_counter(model: BaseModel) -> Callable[[Example], int]:
    tokenizer = _tokenizer(model.id)
    return lambda example: example_token_count(tokenizer, example)
