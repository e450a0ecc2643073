"""The body of ``POST /v1/batches``, in OpenAI's shape, parsed strictly: an unknown field, a wrong
type or a value out of range is a 400 naming it. (The body was read as plain JSON already.)"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from core.batch_input import ENDPOINTS
from core.openai_protocol import checked_metadata

COMPLETION_WINDOWS = ("24h",)  # OpenAI's only window


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: Literal[ENDPOINTS]  # type: ignore[valid-type]
    completion_window: Literal[COMPLETION_WINDOWS]  # type: ignore[valid-type]
    metadata: dict[str, str] | None = None

    _metadata = field_validator("metadata")(checked_metadata)
