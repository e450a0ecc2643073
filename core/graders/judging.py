"""Model graders (score_model, label_model): the request their judge model answers, and reading
its answer. Pure: the platform sends the request (through the serving pool) and hands the reply
back.

The judge answers through structured outputs (vLLM's guided decoding of ``response_format``'s JSON
schema), with the verdict first, ``{"label": ...}`` or ``{"result": ...}``, and an optional
``"reasoning"`` after it: a reply cut short by the token budget still holds the verdict, and
``read_verdict`` takes it from a reply that is not whole JSON.

A score outside the grader's range is clamped into it, as OpenAI's score model grader truncates its
output to the range. A ``developer`` message is sent as ``system``: the chat templates of the
models served here know system, user and assistant.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from core.api_errors import shown
from core.graders.result import Result, error_result
from core.graders.template import MAX_RENDERED_CHARS, substitute

# Greedy, and room for the verdict and a few sentences of reasoning.
DEFAULT_SAMPLING = {"temperature": 0.0, "top_p": 1.0, "seed": None, "max_completion_tokens": 256}

# What the answer format asks for as reasoning. A small judge sometimes copies it as its reasoning:
# that is no reasoning, and is not shown as one.
REASONING_HINT = "one or two sentences"
_LABEL = re.compile(r'"label"\s*:\s*("(?:[^"\\]|\\.)*")')
# The number must be followed by what ends it: a reply cut inside "0.75" must not read as 0.7.
_RESULT = re.compile(r'"result"\s*:\s*(-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)\s*[,}\s]')


@dataclass(frozen=True)
class JudgeRequest:
    model: str
    messages: list[dict]  # chat messages, templates substituted, content as plain strings
    sampling: dict  # temperature, top_p, seed, max_completion_tokens
    response_format: dict  # OpenAI chat's {"type": "json_schema", "json_schema": {...}}


def judge_request(grader: dict, item: dict, sample: dict | None) -> JudgeRequest:
    """The chat request that asks ``grader``'s judge model for its verdict on ``sample``."""
    messages = [
        {"role": "system" if message["role"] == "developer" else message["role"],
         "content": _text(message["content"], item, sample)}
        for message in grader["input"]
    ]
    return JudgeRequest(
        model=grader["model"],
        messages=_with_answer_format(messages, _answer_format(grader)),
        sampling=_sampling(grader.get("sampling_params") or {}),
        response_format=_response_format(grader),
    )


def read_verdict(grader: dict, reply: str) -> Result:
    """The judge's verdict as a Result (``passed`` for a label, None for a score: the engine holds
    the threshold), or an error result with score 0 when the reply holds none."""
    verdict = _parsed(reply)
    reasoning = verdict.get("reasoning") if isinstance(verdict.get("reasoning"), str) else None
    copied = reasoning is not None and reasoning.strip().strip(".").casefold() == REASONING_HINT
    extra = {"reasoning": reasoning} if reasoning and not copied else {}
    if grader["type"] == "label_model":
        label = verdict.get("label") if "label" in verdict else _cut_short(_LABEL, reply, json.loads)
        if not isinstance(label, str) or label not in grader["labels"]:
            return error_result(f"the judge's reply gives no label among {grader['labels']}: {shown(reply, 200)!r}")
        passed = label in grader["passing_labels"]
        return Result(1.0 if passed else 0.0, passed, {"label": label, **extra})
    result = _number(verdict.get("result") if "result" in verdict else _cut_short(_RESULT, reply, float))
    if result is None:
        return error_result(f"the judge's reply gives no numeric result: {shown(reply, 200)!r}")
    low, high = grader.get("range") or (0.0, 1.0)
    return Result(min(max(result, low), high), None, {"result": result, **extra})


def _text(content: object, item: dict, sample: dict | None) -> str:
    """A message's content as one string: a list of text parts joined by newlines."""
    if isinstance(content, str):
        text = content
    else:
        parts = content if isinstance(content, list) else [content]
        text = "\n".join(part["text"] for part in parts if isinstance(part, dict))
    return substitute(text, item, sample)[:MAX_RENDERED_CHARS]


def _answer_format(grader: dict) -> str:
    if grader["type"] == "label_model":
        labels = ", ".join(json.dumps(label, ensure_ascii=False) for label in grader["labels"])
        return f'Answer with JSON: {{"label": one of {labels}, "reasoning": "{REASONING_HINT}"}}.'
    low, high = grader.get("range") or (0.0, 1.0)
    return f'Answer with JSON: {{"result": a number from {low:g} to {high:g}, "reasoning": "{REASONING_HINT}"}}.'


def _with_answer_format(messages: list[dict], answer_format: str) -> list[dict]:
    """The answer format said in the system message (added first where there is none: chat
    templates take one system message, at the start)."""
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{answer_format}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": answer_format}, *messages]


def _sampling(params: dict) -> dict:
    given = {
        "temperature": params.get("temperature"),
        "top_p": params.get("top_p"),
        "seed": params.get("seed"),
        "max_completion_tokens": params.get("max_completions_tokens"),  # OpenAI's grader spells it so
    }
    return {key: DEFAULT_SAMPLING[key] if value is None else value for key, value in given.items()}


def _response_format(grader: dict) -> dict:
    verdict: dict[str, dict]
    if grader["type"] == "label_model":
        name, verdict = "label_verdict", {"label": {"type": "string", "enum": list(grader["labels"])}}
    else:
        low, high = grader.get("range") or (0.0, 1.0)
        name, verdict = "score_verdict", {"result": {"type": "number", "minimum": low, "maximum": high}}
    schema = {
        "type": "object",
        "properties": {**verdict, "reasoning": {"type": "string"}},
        "required": list(verdict),
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": name, "strict": True, "schema": schema}}


def _parsed(reply: str) -> dict:
    try:
        value = json.loads(reply)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _number(value: object) -> float | None:
    """A finite float, or None (a string, a boolean, an integer past a float's range, NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _cut_short(pattern: re.Pattern[str], reply: str, read: Callable[[str], object]) -> object:
    """The verdict's value from a reply that is not whole JSON (cut short by the token budget), when
    it was written whole; None otherwise."""
    match = pattern.search(reply)
    if match is None:
        return None
    try:
        return read(match.group(1))
    except (ValueError, OverflowError):
        return None
