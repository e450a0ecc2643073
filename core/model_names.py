"""The one place that knows how a fine-tuned model is named: ``<base_model_id>:<suffix>``."""

from __future__ import annotations

import re
from dataclasses import dataclass

SUFFIX_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class ModelName:
    base_model_id: str
    suffix: str | None  # None for the base model itself

    def __str__(self) -> str:
        return f"{self.base_model_id}:{self.suffix}" if self.suffix else self.base_model_id


def parse_model_name(name: str) -> ModelName:
    """Split at the last ':' (base ids never hold one; the catalog refuses them)."""
    base, sep, suffix = name.rpartition(":")
    return ModelName(base, suffix) if sep else ModelName(name, None)


def is_valid_suffix(suffix: str) -> bool:
    return SUFFIX_PATTERN.fullmatch(suffix) is not None
