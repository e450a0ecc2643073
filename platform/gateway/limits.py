"""Completions and their tokens per minute, per API key and per organization (``core.rate_limits``
counts them, all four in one round trip).

Checked after the key is known and before the pool is called, for every authenticated request (a
refused model costs the gateway a request too). The playground signs in without a key: only its
organization's limits apply there, the counters its keys share.

Tokens are charged up front, as OpenAI does, so that a limit holds while the generation runs: the
prompt, estimated from its characters (no tokenizer on the hot path), and the most the request may
generate: ``max_tokens`` (or ``max_completion_tokens``) for each of its ``n`` choices, or, when it
sets neither, the model's whole context, which vLLM may then fill. A request that asks for less
fits more of them in a minute.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from core import api_errors
from core.config import LIMIT_SETTINGS
from core.rate_limits import TOKEN_LIMIT_TYPE, Limit, charge_async
from core.request_limits import estimated_prompt_tokens
from finetuning.registry import UsableModel

MINUTE_S = 60


def estimated_tokens(data: dict[str, Any], endpoint: str, model: UsableModel | None) -> int:
    """What a checked request (``core.request_limits``: its numbers are numbers) may cost."""
    if model is None:
        return 0  # refused as not found right after; only the request counts
    prompt = estimated_prompt_tokens(data, endpoint)
    asked = data.get("max_completion_tokens") or data.get("max_tokens")
    context = settings.MODEL_CATALOG.require(model.base_model_id).engine.max_model_len
    choices = max(1, int(data.get("n") or 1))
    return prompt + choices * int(min(asked, context) if asked else context)


def completion_limits(organization_id: int, api_key_id: int | None, tokens: int = 0) -> list[Limit]:
    """The rates a request is held to: its key's (when it has one) and its organization's; token
    rates only when ``tokens`` is charged."""
    limits = settings.CONFIG.limits
    found = []
    if api_key_id is not None:
        found += _rates("key", api_key_id, limits.completions_per_minute_per_key, limits.tokens_per_minute_per_key, tokens)
    found += _rates(
        "organization", organization_id, limits.completions_per_minute_per_organization,
        limits.tokens_per_minute_per_organization, tokens,
    )
    return found


def _rates(scope: str, owner: int, requests: int, token_rate: int, tokens: int) -> list[Limit]:
    whom = "this API key" if scope == "key" else "this organization"
    rates = [
        Limit(
            f"completions:{scope}:{owner}", requests, MINUTE_S, f"{requests} completions per minute for {whom}",
            LIMIT_SETTINGS[f"completions_per_minute_per_{scope}"],
        )
    ]
    if tokens:
        setting = LIMIT_SETTINGS[f"tokens_per_minute_per_{scope}"]
        if tokens > token_rate:
            raise api_errors.request_over_token_rate(tokens, token_rate, setting)
        describe = f"{token_rate:,} tokens per minute for {whom}"
        rates.append(Limit(f"tokens:{scope}:{owner}", token_rate, MINUTE_S, describe, setting, tokens, TOKEN_LIMIT_TYPE))
    return rates


async def check_completion_rate(organization_id: int, api_key_id: int | None = None, tokens: int = 0) -> None:
    """Raise the 429 (with Retry-After) when the key or its organization is over a rate."""
    exceeded = await charge_async(settings.CONFIG.redis_url, completion_limits(organization_id, api_key_id, tokens))
    if exceeded is not None:
        raise exceeded.error()
