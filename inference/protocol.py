"""The parts of the OpenAI protocol this platform reads or writes itself.

Request bodies are forwarded to vLLM byte for byte (sampling parameters, ``response_format``,
``stream_options``, ...: vLLM validates them); the gateway and the pool only read the two fields
they route on. Responses they build themselves (model lists) are defined here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from inference import errors


class RoutedFields(BaseModel):
    """What routing needs from a completion request; every other field is vLLM's business."""

    model_config = ConfigDict(extra="ignore")

    model: str
    stream: bool = False


def routed_fields(body: bytes) -> RoutedFields:
    try:
        return RoutedFields.model_validate_json(body)
    except ValidationError as exc:
        raise errors.invalid_fields(exc, " (send a JSON object with a string 'model')") from None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    parent: str | None = None  # the base model of a fine-tuned model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
