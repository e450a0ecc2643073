"""What a completion request may ask for, checked before it costs the pool anything.

One tenant must not be able to occupy the engine for everyone: generating many choices, many
tokens or many logprobs, or sending a prompt the tokenizer chews on for seconds. Each cap is a
setting (``core.config.RequestLimits``); a refusal is a 400 naming the field and the setting.
The check reads the body the gateway has already parsed (``core.openai_protocol.parse_request``)
and counts characters, not tokens: no tokenizer on the hot path. vLLM still refuses, exactly, a
prompt longer than the model's context.
"""

from __future__ import annotations

import math
from typing import Any

from core import api_errors
from core.config import Limit, RequestLimits
from core.openai_protocol import REQUEST_FIELDS
from core.tool_calls import request_tools_problem

CHARS_PER_TOKEN = 4  # OpenAI's rule of thumb for English text


def _numeric_caps(endpoint: str, limits: RequestLimits) -> dict[str, Limit]:
    caps = {
        "n": limits.completion_n,
        "max_tokens": limits.completion_tokens,
        "min_tokens": limits.completion_tokens,
        "prompt_logprobs": limits.logprobs,
    }
    if endpoint == "chat/completions":  # there ``logprobs`` is a yes/no and ``top_logprobs`` the count
        return caps | {"max_completion_tokens": limits.completion_tokens, "top_logprobs": limits.logprobs}
    return caps | {"logprobs": limits.logprobs}


def check_request(data: dict[str, Any], endpoint: str, limits: RequestLimits) -> None:
    """Raise a 400 ``ApiError`` for the first field that is unknown or over its cap."""
    allowed = REQUEST_FIELDS[endpoint]
    for name in data:
        if name not in allowed:
            raise api_errors.unknown_field(name, endpoint)
    for name, limit in _numeric_caps(endpoint, limits).items():
        value = data.get(name)
        if value is None:
            continue
        # vLLM's models are lax: they would take "9" or 9e9 as a count, so a string is refused
        # here and a float is compared as the number it is.
        if not isinstance(value, int | float):
            raise api_errors.not_a_number(name)
        if value > limit.value:
            raise api_errors.over_limit(name, f"'{name}'", value, limit.value, limit.setting)
    adapters = data.get("adapters")
    if isinstance(adapters, list) and len(adapters) > limits.mix_adapters.value:
        limit = limits.mix_adapters
        raise api_errors.over_limit("adapters", "The number of adapters", len(adapters), limit.value, limit.setting)
    prompt = data.get(prompt_field(endpoint))
    if endpoint == "chat/completions" and isinstance(prompt, list) and len(prompt) > limits.messages.value:
        limit = limits.messages
        raise api_errors.over_limit("messages", "The number of messages", len(prompt), limit.value, limit.setting)
    chars = prompt_text_chars(data, endpoint)
    if chars > limits.prompt_chars.value:
        limit = limits.prompt_chars
        what = f"The text of '{prompt_field(endpoint)}'" + (" and 'tools'" if data.get("tools") else "")
        raise api_errors.over_limit(prompt_field(endpoint), what, chars, limit.value, limit.setting, unit=" characters")
    # After the caps: the tools' schemas are checked only once their text is known to be within them.
    if endpoint == "chat/completions":
        param, problem = request_tools_problem(data.get("tools"), data.get("tool_choice"), data.get("parallel_tool_calls"))
        if problem:
            raise api_errors.invalid_tools(param, problem)


def prompt_field(endpoint: str) -> str:
    return {"chat/completions": "messages", "responses": "input"}.get(endpoint, "prompt")


def estimated_prompt_tokens(data: dict[str, Any], endpoint: str) -> int:
    """A prompt's tokens, estimated from its characters (what rate limits and batch queues charge)."""
    return math.ceil(prompt_text_chars(data, endpoint) / CHARS_PER_TOKEN)


def prompt_text_chars(data: dict[str, Any], endpoint: str) -> int:
    """The characters the prompt is rendered from: its messages or prompt, and the tools the chat
    template writes into it."""
    return prompt_chars(data.get(prompt_field(endpoint))) + prompt_chars(data.get("tools"))


def prompt_chars(value: Any) -> int:
    """The characters of every string in a prompt or message list, a token id counting as one.

    Walks the parsed JSON with a list, not recursion: a deeply nested body must not exhaust the
    stack. Role names count too; against a cap of many thousands they change nothing.
    """
    total, pending = 0, [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, int) and not isinstance(item, bool):
            total += 1
    return total
