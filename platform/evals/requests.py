"""The request bodies of the evals API, in OpenAI's shape with the platform's additions, parsed
strictly: an unknown field, a wrong type or a number out of range is a 400 naming it. (The body was
read as plain JSON already: ``server.json_parser``.) Testing criteria are ``evals.criteria``'s."""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from django.conf import settings
from pydantic import BaseModel, ConfigDict, Field, field_validator

from answering.batch import Sampling, Target
from core.openai_protocol import AdapterShare, checked_metadata

MAX_MODELS_PER_CALL = 8  # runs one call may start, to compare models


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class DataSourceConfig(_Strict):
    """OpenAI's ``custom`` config; the items are always the file's examples (``evals.representations.ITEM_SCHEMA``)."""

    type: Literal["custom"]
    item_schema: dict[str, Any] | None = None  # accepted as the client sends it; the items' shape is fixed
    include_sample_schema: bool | None = None


class EvalCreate(_Strict):
    name: str | None = Field(None, max_length=256)
    data_source_config: DataSourceConfig | None = None
    testing_criteria: list[Any]  # checked by ``evals.criteria.checked_criteria``
    file: str = Field(min_length=1, max_length=64)  # ours: the examples, an uploaded file's id
    metadata: dict[str, str] | None = None

    _metadata = field_validator("metadata")(checked_metadata)


class FileSource(_Strict):
    type: Literal["file_id"]
    id: str = Field(min_length=1, max_length=64)


class ItemReference(_Strict):
    """The only input this platform builds prompts from: the example's messages before its answer."""

    type: Literal["item_reference"]
    item_reference: Literal["item.input"]


class SamplingParams(_Strict):
    max_completion_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)

    @field_validator("max_completion_tokens")
    @classmethod
    def _within_cap(cls, value: int) -> int:
        cap = settings.CONFIG.request_limits.completion_tokens
        if value > cap.value:
            raise ValueError(f"at most {cap.value} ({cap.setting})")
        return value


class DataSource(_Strict):
    type: Literal["completions"]
    model: str | None = Field(None, min_length=1, max_length=300)
    adapters: list[AdapterShare] | None = Field(None, min_length=1)  # ours: a mix on ``model``, as in completions
    source: FileSource | None = None  # default: the eval's file
    input_messages: ItemReference | None = None
    sampling_params: SamplingParams | None = None  # default: greedy, 64 tokens


class ModelChoice(_Strict):
    model: str = Field(min_length=1, max_length=300)
    adapters: list[AdapterShare] | None = Field(None, min_length=1)


class RunCreate(_Strict):
    name: str | None = Field(None, max_length=256)
    data_source: DataSource
    # ours: more models to run on the same eval, each a run of its own (names or {"model", "adapters"})
    models: list[str | ModelChoice] | None = Field(None, min_length=1, max_length=MAX_MODELS_PER_CALL)
    metadata: dict[str, str] | None = None

    _metadata = field_validator("metadata")(checked_metadata)

    def targets(self) -> list[tuple[str, Target]]:
        """Each model to run, with where the request names it (for a refusal's ``param``)."""
        found = []
        if self.data_source.model is not None:
            found.append(("data_source", _target(self.data_source.model, self.data_source.adapters)))
        for index, choice in enumerate(self.models or []):
            if isinstance(choice, str):
                found.append((f"models.{index}", Target(choice)))
            else:
                found.append((f"models.{index}", _target(choice.model, choice.adapters)))
        return found

    def sampling(self) -> Sampling:
        params = self.data_source.sampling_params or SamplingParams.model_validate({})
        return Sampling(params.max_completion_tokens, params.temperature, params.top_p, params.seed)


def _target(model: str, adapters: list[AdapterShare] | None) -> Target:
    return Target(model, tuple((share.model, share.scale) for share in adapters or ()))


_Body = TypeVar("_Body", bound=BaseModel)


class EvalUpdate(_Strict):
    name: str | None = Field(None, min_length=1, max_length=256)
    metadata: dict[str, str] | None = None

    _metadata = field_validator("metadata")(checked_metadata)
