"""Composed models' tests (the API's and the dashboard's): the suffixes they publish under, and three
fine-tuned models to compose."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.inference_fixtures import publish_fine_tuned_model as published

SUFFIXES = [
    "left", "right", "third", "blend", "approx", "tied", "dared", "refused", "kept", "theirs", "twice", "orphan",
    "squeezed", "capped-1", "capped-2", "capped-3", "hourly-1", "hourly-2", "hourly-3",
]


@pytest.fixture
def parents(alice, make_adapter) -> dict[str, Path]:
    """Three of alice's fine-tuned models, rank 8 each (max_lora_rank is 16), by name."""
    folders = [make_adapter(seed=11), make_adapter(seed=12), make_adapter(seed=13)]
    return {published(alice, suffix, folder): folder for suffix, folder in zip(["left", "right", "third"], folders)}
