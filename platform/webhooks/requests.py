"""The request bodies of the webhooks API, parsed strictly: an unknown field or a wrong type is a 400
naming it. The URL itself is checked by ``webhooks.targets``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from webhooks.event_types import EventType
from webhooks.targets import MAX_URL_CHARS


def _checked_event_types(value: list[str] | None) -> list[str] | None:
    if value is None:
        return value
    unknown = [name for name in value if name not in EventType.values]
    if unknown:
        raise ValueError(f"unknown event type '{unknown[0][:64]}'; use any of: {', '.join(EventType.values)}")
    return list(dict.fromkeys(value))  # each once, in the order given


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class EndpointCreate(_Strict):
    url: str = Field(min_length=1, max_length=MAX_URL_CHARS)
    description: str = Field("", max_length=256)
    # Empty or absent: every event type, those added later too.
    event_types: list[str] | None = Field(None, max_length=len(EventType.values))
    enabled: bool = True

    _event_types = field_validator("event_types")(_checked_event_types)


class EndpointUpdate(_Strict):
    url: str | None = Field(None, min_length=1, max_length=MAX_URL_CHARS)
    description: str | None = Field(None, max_length=256)
    event_types: list[str] | None = Field(None, max_length=len(EventType.values))
    enabled: bool | None = None

    _event_types = field_validator("event_types")(_checked_event_types)
