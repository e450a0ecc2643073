"""Sampling for the Tinker protocol: N completions of a token prompt from saved weights (or the base
model), answered by the serving pool as any completion is (the same batching, adapter slots, fair
share and usage), with each sampled token's id and log-probability; and the prompt's own
log-probabilities (``compute_logprobs``).

What a sampling session samples from: ``training_loops.samplers``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from answering.batch import refusal_words
from answering.forward import forward
from core.api_errors import ApiError
from core.openai_protocol import parse_request
from core.tinker_wire import Sequence
from training_loops.samplers import Sampler
from usage.meter import Caller

MAX_SAMPLES = 64  # completions per sample request
MAX_PROMPT_TOKENS = 8192
MAX_NEW_TOKENS = 2048


class _Params(BaseModel):
    model_config = ConfigDict(extra="ignore")

    max_tokens: int | None = Field(default=None, ge=1, le=MAX_NEW_TOKENS)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(default=1.0, ge=0, le=10)
    top_k: int = Field(default=-1, ge=-1, le=100_000)
    top_p: float = Field(default=1.0, gt=0, le=1)


class _Chunk(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str = "encoded_text"
    tokens: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(default_factory=list, max_length=MAX_PROMPT_TOKENS)


class _Prompt(BaseModel):
    model_config = ConfigDict(extra="ignore")

    chunks: list[_Chunk] = Field(max_length=1024)


class SampleCall(BaseModel):
    """The fields of the SDK's SampleRequest this server acts on; the rest it refuses by name."""

    model_config = ConfigDict(extra="ignore")

    num_samples: int = Field(default=1, ge=1, le=MAX_SAMPLES)
    prompt: _Prompt
    sampling_params: _Params
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = Field(default=None, ge=0, lt=2**63)
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = Field(default=0, ge=0, le=0)
    topk_sample_logprobs: int = Field(default=0, ge=0, le=0)
    prompt_alt_tokens_k: int = Field(default=0, ge=0, le=0)
    target_prompt_logprobs: Any = Field(default=None)

    def tokens(self) -> list[int]:
        if any(chunk.type != "encoded_text" for chunk in self.prompt.chunks):
            raise ApiError("prompt: only text tokens (encoded_text chunks) are taken here", param="prompt")
        tokens = [token for chunk in self.prompt.chunks for token in chunk.tokens]
        if not tokens:
            raise ApiError("prompt holds no tokens", param="prompt")
        if len(tokens) > MAX_PROMPT_TOKENS:
            raise ApiError(f"prompt holds {len(tokens):,} tokens; at most {MAX_PROMPT_TOKENS:,}", param="prompt")
        return tokens


def completion_body(model: str, call: SampleCall, tokens: list[int]) -> dict[str, Any]:
    """The pool's completion request for ``call``: the prompt as token ids, each sampled token's id
    and log-probability back (vLLM's ``return_token_ids`` and ``logprobs``)."""
    params = call.sampling_params
    body: dict[str, Any] = {
        "model": model, "prompt": tokens, "n": call.num_samples, "temperature": params.temperature,
        "top_p": params.top_p, "top_k": params.top_k, "logprobs": 0, "return_token_ids": True,
        "max_tokens": params.max_tokens or 16,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if isinstance(params.stop, str):
        body["stop"] = [params.stop]
    elif params.stop and isinstance(params.stop[0], int):
        body["stop_token_ids"] = params.stop
    elif params.stop is not None:
        body["stop"] = params.stop
        body["ignore_eos"] = not params.stop  # ``[]``: no stop at all, EOS included (the SDK's meaning)
    if call.prompt_logprobs:
        body["prompt_logprobs"] = 0
    return body


@dataclass(frozen=True)
class Sampled:
    sequences: list[Sequence]
    prompt_logprobs: list[float] | None

    def as_json(self) -> dict[str, Any]:
        return {"sequences": [sequence.__dict__ for sequence in self.sequences], "prompt_logprobs": self.prompt_logprobs}


async def sample(sampler: Sampler, call: SampleCall, tokens: list[int]) -> Sampled:
    """The pool's completions as sequences; an ApiError with the pool's own refusal otherwise."""
    # Greedy samples are all the one answer, and vLLM takes n > 1 only when sampling: ask once.
    greedy = call.sampling_params.temperature == 0
    asked = call.model_copy(update={"num_samples": 1}) if greedy else call
    body = json.dumps(completion_body(sampler.model, asked, tokens)).encode()
    caller = Caller(sampler.organization_id, None, sampler.model)
    answer = await forward(body, parse_request(body), "completions", caller)
    if answer.status != 200:
        _code, message = refusal_words(answer.status, answer.body)
        raise ApiError(message, status=answer.status if 400 <= answer.status < 600 else 502, code="sample_refused")
    data = json.loads(answer.body)
    choices = sorted(data["choices"], key=lambda choice: choice["index"])
    sequences = [
        Sequence(choice["token_ids"], list(choice["logprobs"]["token_logprobs"]), choice.get("finish_reason") != "length")
        for choice in choices
    ]
    prompt = _prompt_logprobs(choices[0].get("prompt_logprobs"), tokens) if call.prompt_logprobs else None
    return Sampled(sequences * call.num_samples if greedy else sequences, prompt)


def _prompt_logprobs(found: list | None, tokens: list[int]) -> list[float]:
    """vLLM's per-position ``{token id: {"logprob"}}`` as the prompt's own tokens' log-probabilities
    (NaN for the first, which nothing precedes)."""
    values = []
    for position, token in enumerate(tokens):
        entry = (found or [])[position] if position < len(found or []) else None
        logprob = (entry or {}).get(str(token), {}).get("logprob") if isinstance(entry, dict) else None
        values.append(float(logprob) if logprob is not None else math.nan)
    return values
