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
MAX_TEMPLATE_CHARS = 10_000  # one message of an input_messages template
MAX_TEMPLATE_MESSAGES = 32


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class DataSourceConfig(_Strict):
    """OpenAI's ``custom`` config: the JSON schema every item is checked against (``evals.items``).
    Without it, the eval's ``file`` (ours) gives the items, in ``evals.sources.CHAT_ITEM_SCHEMA``."""

    type: str
    item_schema: dict[str, Any] | None = None
    include_sample_schema: bool = False

    @field_validator("type")
    @classmethod
    def _custom(cls, value: str) -> str:
        if value in ("logs", "stored_completions"):
            raise ValueError(f"'{value}' reads stored completions, which this platform does not keep; use 'custom'")
        if value != "custom":
            raise ValueError("must be 'custom'")
        return value


class EvalCreate(_Strict):
    name: str | None = Field(None, max_length=256)
    data_source_config: DataSourceConfig | None = None
    testing_criteria: list[Any]  # checked by ``evals.criteria.checked_criteria``
    file: str | None = Field(None, min_length=1, max_length=64)  # ours: a chat file's examples as the items
    metadata: dict[str, str] | None = None

    _metadata = field_validator("metadata")(checked_metadata)


class Source(_Strict):
    """Where a run's items come from: inline (``file_content``) or a file (``file_id``: purpose
    ``evals``, or a chat file of ``fine-tune`` lines)."""

    type: Literal["file_content", "file_id"]
    content: list[Any] | None = None  # file_content: [{"item": {...}, "sample"?: {...}}], checked by ``evals.items``
    id: str | None = Field(None, min_length=1, max_length=64)  # file_id


class TextPart(_Strict):
    type: Literal["input_text", "output_text"]
    text: str = Field(max_length=MAX_TEMPLATE_CHARS)


class TemplateMessage(_Strict):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | TextPart | list[TextPart] = Field(max_length=MAX_TEMPLATE_CHARS)
    type: Literal["message"] | None = None


class InputMessages(_Strict):
    """The prompt of each item: a ``template`` of messages over ``{{item.*}}``, or an
    ``item_reference`` naming the item's field that holds the messages (``item.input``)."""

    type: Literal["template", "item_reference"]
    template: list[TemplateMessage] | None = Field(None, min_length=1, max_length=MAX_TEMPLATE_MESSAGES)
    item_reference: str | None = Field(None, min_length=1, max_length=256)


class SamplingParams(_Strict):
    max_completion_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    # Passed on to each chat request as they are, so the gateway's own checks judge them.
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    text: dict[str, Any] | None = None  # the responses data source's: {"format": <a response format>}

    @field_validator("max_completion_tokens")
    @classmethod
    def _within_cap(cls, value: int) -> int:
        cap = settings.CONFIG.request_limits.completion_tokens
        if value > cap.value:
            raise ValueError(f"at most {cap.value} ({cap.setting})")
        return value


class DataSource(_Strict):
    """``completions`` and ``responses`` (both answered as chat completions here): a model answers
    each item's prompt; ``jsonl``: each item brings its ``sample``, and no model answers."""

    type: Literal["completions", "responses", "jsonl"]
    model: str | None = Field(None, min_length=1, max_length=300)
    adapters: list[AdapterShare] | None = Field(None, min_length=1)  # ours: a mix on ``model``, as in completions
    source: Source | None = None  # default: the eval's file
    input_messages: InputMessages | None = None  # default: item_reference item.input
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
        response_format = params.response_format or _chat_format((params.text or {}).get("format"))
        tools = [_chat_tool(tool) for tool in params.tools] if params.tools else None
        return Sampling(params.max_completion_tokens, params.temperature, params.top_p, params.seed, response_format, tools)


def _chat_format(text_format: object) -> dict | None:
    """The Responses API's ``text.format`` as chat's ``response_format`` (its json_schema is flat there)."""
    if not isinstance(text_format, dict):
        return None
    if text_format.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in text_format.items() if k != "type"}}
    return text_format


def _chat_tool(tool: dict) -> dict:
    """A Responses API function tool (flat: ``{"type", "name", "parameters"}``) as chat's; a chat tool as it is."""
    if tool.get("type") == "function" and "function" not in tool:
        return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
    return tool


def _target(model: str, adapters: list[AdapterShare] | None) -> Target:
    return Target(model, tuple((share.model, share.scale) for share in adapters or ()))


_Body = TypeVar("_Body", bound=BaseModel)


class EvalUpdate(_Strict):
    name: str | None = Field(None, min_length=1, max_length=256)
    metadata: dict[str, str] | None = None

    _metadata = field_validator("metadata")(checked_metadata)
