"""The parts of the OpenAI protocol this platform reads or writes itself.

Request bodies go to vLLM as they came (vLLM validates sampling parameters, ``response_format``,
``stream_options``, ...), bar the organization's ``cache_salt`` the gateway sets. The gateway
reads the field names (``REQUEST_FIELDS``), the caps of ``core.request_limits`` and the two
fields it routes on; the pool only the routed ones. Responses they build themselves (model lists)
are defined here. It is the contract between the platform and the pool, so it lives in ``core``:
each side imports it, and neither imports the other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core import api_errors, strict_json

# The header in which the gateway names the organization a completion is for, to the pool (a trusted
# hop: the pool answers only the internal token, and the gateway never passes a caller's headers on).
# The pool counts adapters against it (``inference.adapter_slots.FairUse``).
ORGANIZATION_HEADER = "fineserve-organization"

# The header by which the gateway marks work nobody is waiting on token by token (a batch's lines, an
# evaluation's answers): the pool lets it yield to live requests on a replica (``inference.background_turns``).
BACKGROUND_HEADER = "fineserve-background"

# Scales of a mix beyond this push a layer far from anything its adapters were trained for (the
# output degenerates into noise long before), and negative ones subtract an adapter's behaviour
# ("task negation"); the bound keeps a typo like 50 from passing as a meaningful request.
MAX_ADAPTER_SCALE = 2.0

MAX_METADATA_KEYS = 16  # OpenAI's limit on an object's metadata (a job's, an eval's, a run's)


def checked_metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's rule: at most 16 keys of at most 64 characters, values of at most 512."""
    if value is not None:
        if len(value) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} keys")
        if any(len(key) > 64 for key in value):
            raise ValueError("keys of at most 64 characters")
        if any(len(item) > 512 for item in value.values()):
            raise ValueError("values of at most 512 characters")
    return value


class AdapterShare(BaseModel):
    """One entry of ``adapters``: a fine-tuned model, by name, and how much of its LoRA delta to add."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(strict=True)
    # strict: "0.5" or true are refused, not read as numbers; NaN and infinities too
    scale: float = Field(1.0, strict=True, ge=-MAX_ADAPTER_SCALE, le=MAX_ADAPTER_SCALE, allow_inf_nan=False)


class RoutedFields(BaseModel):
    """What routing needs from a completion request; every other field is vLLM's business."""

    model_config = ConfigDict(extra="ignore")

    model: str
    stream: bool = False
    # A mix of fine-tunes of the base model ``model`` names, served as one adapter (docs/api.md: Mixing adapters)
    adapters: list[AdapterShare] | None = None


def adapter_scales(fields: RoutedFields) -> dict[str, float]:
    """The adapters a mix adds, each once (a repeated one's scales add up: the deltas are linear),
    sorted by name, without those whose scale is 0 (they add nothing and cost nothing)."""
    scales: dict[str, float] = {}
    for share in fields.adapters or ():
        scales[share.model] = scales.get(share.model, 0.0) + share.scale
    return {name: scales[name] for name in sorted(scales) if scales[name] != 0.0}


_HINT = " (send a JSON object with a string 'model')"


def routed_fields(body: bytes) -> RoutedFields:
    return parse_request(body).routed


def with_fields(body: bytes, **changes: str | None) -> bytes:
    """The JSON ``body`` with these fields set (None: taken out)."""
    data = strict_json.body(body)
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    return json.dumps(data).encode()


@dataclass(frozen=True)
class ParsedRequest:
    routed: RoutedFields
    data: dict[str, Any]  # the whole body, parsed once, for the checks that need more than routing


def parse_request(body: bytes) -> ParsedRequest:
    """The body parsed once, by ``core.strict_json`` (plain JSON only: no NaN, no integer of
    thousands of digits, ...), as ``routed_fields`` parses it: the gateway that checks a request and
    the pool that routes it must read it the same way (both take the last of duplicated keys, as
    vLLM's ``json.loads`` does)."""
    data = strict_json.body(body)
    try:
        return ParsedRequest(RoutedFields.model_validate(data), data)
    except ValidationError as exc:
        raise api_errors.invalid_fields(exc, _HINT) from None


# What a caller may send: OpenAI's request fields that vLLM implements, and the vLLM extensions
# (sampling parameters, structured output) documented in its "Extra parameters". Left out, so a
# 400 names them: OpenAI fields vLLM ignores (``store``, ``audio``, ``metadata``, ...: a caller
# would think they worked), fields vLLM removed (``guided_json``, ``best_of``: ignored too), and
# vLLM's operator-side fields (``kv_transfer_params``, ``priority``, ``request_id``,
# ``chat_template``, ``prompt_embeds``, ``vllm_xargs``, ...). ``cache_salt`` is accepted and
# replaced by the organization's own (``answering.cache_salt``).
_SHARED_FIELDS = frozenset({
    # OpenAI
    "model", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "frequency_penalty",
    "presence_penalty", "stop", "seed", "logit_bias", "user", "response_format",
    # vLLM
    "top_k", "min_p", "repetition_penalty", "length_penalty", "use_beam_search", "min_tokens", "ignore_eos",
    "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
    "allowed_token_ids", "bad_words", "prompt_logprobs", "truncate_prompt_tokens", "add_special_tokens",
    "structured_outputs", "cache_salt",
    # ours
    "adapters",
})
REQUEST_FIELDS: dict[str, frozenset[str]] = {
    "chat/completions": _SHARED_FIELDS | {
        "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
        "parallel_tool_calls", "reasoning_effort", "echo", "add_generation_prompt", "continue_final_message",
    },
    "completions": _SHARED_FIELDS | {"prompt", "suffix", "echo", "logprobs"},
}


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    parent: str | None = None  # the base model of a fine-tuned model
    # A fine-tuned model's origin: {"origin": "trained", "job"}, {"origin": "uploaded"}, or
    # {"origin": "composed", "parents": [{"model", "scale"}], "method", "rank", "approximation_error"}
    lineage: dict[str, Any] | None = None
    # A fine-tuned model's revision: the one its name answers with (``<id>@r<N>`` pins one)
    revision: int | None = None
    # Whether it runs now, as the pool says: {"state": "loaded" (on "replicas" replicas), "ready"
    # (a fine-tune whose base runs: loads on its first request), "waking", "starting", "asleep" or
    # "cold" (scaled to zero: its next request wakes or starts a replica)}; None when the pool does not answer
    serving: dict[str, Any] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
