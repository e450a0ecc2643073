"""Training data: parse and check a JSONL upload line by line, before anything is stored or queued.

Two line shapes are accepted, as in OpenAI's fine-tuning API:
- chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": "...", "weight": 0|1}, ...]}``
- prompt/completion: ``{"prompt": "...", "completion": "..."}``, trained as one user turn and one
  assistant turn.
Every problem names its line, so a person can fix the file in one pass.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

ROLES = ("system", "user", "assistant")
MAX_REPORTED_ERRORS = 20

Message = dict  # {"role": str, "content": str, "weight": int}
Example = list[Message]


@dataclass(frozen=True)
class LineError:
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


@dataclass
class Dataset:
    examples: list[Example] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)  # the file line of each example
    errors: list[LineError] = field(default_factory=list)
    problem: str | None = None  # a whole-file problem (empty, not UTF-8, too few examples)

    @property
    def ok(self) -> bool:
        return self.problem is None and not self.errors


def _message(raw: object, index: int) -> tuple[Message | None, str | None]:
    where = f"messages[{index}]"
    if not isinstance(raw, dict):
        return None, f"{where} must be an object with 'role' and 'content'"
    role, content = raw.get("role"), raw.get("content")
    if role not in ROLES:
        return None, f"{where}.role must be one of {', '.join(ROLES)}"
    if not isinstance(content, str):
        return None, f"{where}.content must be a string"
    weight = raw.get("weight", 1)
    if "weight" in raw and role != "assistant":
        return None, f"{where}.weight is only allowed on assistant messages"
    if weight not in (0, 1) or isinstance(weight, bool):
        return None, f"{where}.weight must be 0 or 1"
    return {"role": role, "content": content, "weight": weight}, None


def _chat_example(record: dict) -> tuple[Example | None, str | None]:
    raw_messages = record["messages"]
    if not isinstance(raw_messages, list) or not raw_messages:
        return None, "messages must be a non-empty list"
    messages = []
    for index, raw in enumerate(raw_messages):
        message, error = _message(raw, index)
        if error:
            return None, error
        messages.append(message)
    assistant = [m for m in messages if m["role"] == "assistant"]
    if not assistant:
        return None, "needs at least one assistant message to learn from"
    if not any(m["weight"] for m in assistant):
        return None, "every assistant message has weight 0, so there is nothing to learn"
    return messages, None


def _completion_example(record: dict) -> tuple[Example | None, str | None]:
    prompt, completion = record.get("prompt"), record.get("completion")
    if not isinstance(prompt, str) or not isinstance(completion, str):
        return None, "prompt and completion must both be strings"
    return [
        {"role": "user", "content": prompt, "weight": 1},
        {"role": "assistant", "content": completion, "weight": 1},
    ], None


def parse_example(line: str) -> tuple[Example | None, str | None]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON ({exc.msg} at column {exc.colno})"
    if not isinstance(record, dict):
        return None, 'must be a JSON object with "messages", or "prompt" and "completion"'
    if "messages" in record and ("prompt" in record or "completion" in record):
        return None, 'use either "messages" or "prompt"/"completion", not both'
    if "messages" in record:
        return _chat_example(record)
    if "prompt" in record or "completion" in record:
        return _completion_example(record)
    return None, 'must have "messages", or "prompt" and "completion"'


def _decode(data: bytes) -> tuple[str | None, str | None]:
    try:
        return data.decode("utf-8-sig"), None
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        return None, f"the file is not UTF-8 text (line {line} has the byte 0x{data[exc.start]:02x})"


def parse_dataset(
    data: bytes,
    min_examples: int,
    count_tokens: Callable[[Example], int] | None = None,
    max_tokens: int | None = None,
) -> Dataset:
    """Check every line; report up to MAX_REPORTED_ERRORS problems with their line numbers."""
    text, problem = _decode(data)
    if problem:
        return Dataset(problem=problem)
    if not text.strip():
        return Dataset(problem="the file is empty")
    dataset, bad_lines = Dataset(), 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue  # blank lines (a trailing newline, say) are harmless
        example, error = parse_example(line)
        if error is None and count_tokens is not None and max_tokens is not None:
            tokens = count_tokens(example)
            if tokens > max_tokens:
                error = f"{tokens} tokens, longer than the model's context of {max_tokens} tokens"
        if error:
            bad_lines += 1
            if len(dataset.errors) < MAX_REPORTED_ERRORS:
                dataset.errors.append(LineError(number, error))
            continue
        dataset.examples.append(example)
        dataset.lines.append(number)
    if bad_lines > len(dataset.errors):
        dataset.problem = f"{bad_lines} lines have problems; the first {len(dataset.errors)} are listed"
    elif not dataset.errors and len(dataset.examples) < min_examples:
        dataset.problem = f"needs at least {min_examples} examples, found {len(dataset.examples)}"
    return dataset
