"""Training data: parse and check a JSONL upload line by line, before anything is stored or queued.

Two line shapes are accepted, as in OpenAI's fine-tuning API:
- chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": "...", "weight": 0|1}, ...]}``
- prompt/completion: ``{"prompt": "...", "completion": "..."}``, trained as one user turn and one
  assistant turn.
Every problem names its line, so a person can fix the file in one pass. Whatever the bytes, a line
gets an example or an error, never an exception: the upload answers 400 with the line, not 500.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

ROLES = ("system", "user", "assistant")
MAX_REPORTED_ERRORS = 20

# JSON nested deeper than this is refused before it is parsed: a training line needs 3 levels
# ({"messages": [{...}]}), and Python's parser raises RecursionError at about 1,000.
MAX_NESTING_DEPTH = 32
# With the model's context known, a line that could not fit it is refused before it is parsed or
# tokenized (tokenizing is the slow step: 0.13 s for 140 KB). The caps scale with the context, so a
# model with a longer one gets longer lines, and they are loose on purpose: no line that fits is refused.
MAX_CHARS_PER_TOKEN = 128  # of the JSON line; SmolLM2's longest token is 82 characters, real text is 3-12
MIN_TOKENS_PER_MESSAGE = 2  # any chat template spends at least a role marker and an end-of-turn on a message

Message = dict  # {"role": str, "content": str, "weight": int}
Example = list[Message]


class ExampleError(ValueError):
    """A parsed example that cannot be used after all, found while counting its tokens (the chat template
    refuses it, say); ``parse_dataset`` reports it as the line's problem."""


def max_line_chars(max_tokens: int) -> int:
    return max_tokens * MAX_CHARS_PER_TOKEN


def max_messages(max_tokens: int) -> int:
    return max_tokens // MIN_TOKENS_PER_MESSAGE


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


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def _nesting_depth(line: str) -> int:
    """How deep the JSON's brackets nest outside its strings, found by string methods: no recursion, and
    no Python loop over the characters.

    Without its escaped backslashes and quotes, a line's quotes alternate between opening and closing a
    string, so every other piece between quotes is outside the strings.
    """
    unescaped = line.replace("\\\\", "").replace('\\"', "")
    outside_strings = "".join(unescaped.split('"')[0::2])
    return max(itertools.accumulate(map(_DEPTH_STEP.get, outside_strings, itertools.repeat(0))), default=0)


def _line_problem(line: str, max_tokens: int | None) -> str | None:
    """What is wrong with a line before it is even parsed."""
    if max_tokens is not None and len(line) > max_line_chars(max_tokens):
        return (
            f"the line is {len(line):,} characters long, more than the {max_line_chars(max_tokens):,} allowed "
            f"for the model's context of {max_tokens} tokens: split the conversation over several lines"
        )
    if "\x00" in line:
        return "contains NUL bytes (0x00), so the file looks binary or UTF-16: save it as UTF-8 text"
    depth = _nesting_depth(line)
    if depth > MAX_NESTING_DEPTH:
        return f"the JSON is nested {depth:,} levels deep, more than {MAX_NESTING_DEPTH}: a training line needs 3"
    return None


def _text_problem(text: str, where: str) -> str | None:
    """What in a string must not reach the trainer, which JSON escapes can write: a lone surrogate (the
    tokenizer refuses it; UTF-8 cannot even carry it) and NUL (never text: a sign of binary data)."""
    if "\x00" in text:
        return f"{where} contains a NUL character (\\u0000): remove it"
    surrogate = _LONE_SURROGATE.search(text)
    if surrogate:
        return (
            f"{where} contains \\u{ord(surrogate.group()):04x}, half of a UTF-16 surrogate pair without its other "
            "half: remove it, or write the whole character"
        )
    return None


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
    error = _text_problem(content, f"{where}.content")
    if error:
        return None, error
    return {"role": role, "content": content, "weight": weight}, None


def _chat_example(record: dict, max_tokens: int | None) -> tuple[Example | None, str | None]:
    raw_messages = record["messages"]
    if not isinstance(raw_messages, list) or not raw_messages:
        return None, "messages must be a non-empty list"
    if max_tokens is not None and len(raw_messages) > max_messages(max_tokens):
        return None, (
            f"{len(raw_messages):,} messages, more than the {max_messages(max_tokens):,} allowed for the model's "
            f"context of {max_tokens} tokens: split the conversation over several lines"
        )
    messages = []
    for index, raw in enumerate(raw_messages):
        message, error = _message(raw, index)
        if message is None:
            return None, error
        messages.append(message)
    # A reply is trained after the prompt the conversation before it makes, and a conversation that opens
    # with the assistant has none (the tokenizer refuses to render an empty conversation). A system
    # message alone is a prompt, so a greeting after it stays a valid example.
    if messages[0]["role"] == "assistant":
        return None, "messages[0] is from the assistant: start with the user (or system) message it answers"
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
    error = _text_problem(prompt, "prompt") or _text_problem(completion, "completion")
    if error:
        return None, error
    return [
        {"role": "user", "content": prompt, "weight": 1},
        {"role": "assistant", "content": completion, "weight": 1},
    ], None


def _json_record(line: str) -> tuple[object, str | None]:
    try:
        return json.loads(line), None
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON ({exc.msg} at column {exc.colno})"
    except ValueError:  # not a JSONDecodeError: Python refuses to convert an integer this long
        return None, "has a number with more than 4,300 digits, too long to read"


def parse_example(line: str, max_tokens: int | None = None) -> tuple[Example | None, str | None]:
    """One line's example, or what is wrong with it. With ``max_tokens``, the model's context, a line
    too long to fit is refused before it is parsed."""
    error = _line_problem(line, max_tokens)
    if error:
        return None, error
    record, error = _json_record(line)
    if error:
        return None, error
    if not isinstance(record, dict):
        return None, 'must be a JSON object with "messages", or "prompt" and "completion"'
    if "messages" in record and ("prompt" in record or "completion" in record):
        return None, 'use either "messages" or "prompt"/"completion", not both'
    if "messages" in record:
        return _chat_example(record, max_tokens)
    if "prompt" in record or "completion" in record:
        return _completion_example(record)
    return None, 'must have "messages", or "prompt" and "completion"'


def _decode(data: bytes) -> tuple[str | None, str | None]:
    try:
        return data.decode("utf-8-sig"), None
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        return None, f"the file is not UTF-8 text (line {line} has the byte 0x{data[exc.start]:02x})"


def _numbered_lines(text: str) -> Iterator[tuple[int, str]]:
    r"""JSONL lines end with "\n", optionally "\r\n". Not str.splitlines(): it also splits at U+2028, U+0085
    and other characters a JSON string may hold as they are, cutting a valid line in two."""
    for number, line in enumerate(text.split("\n"), start=1):
        yield number, line.removesuffix("\r")


def _token_problem(example: Example, count_tokens: Callable[[Example], int], max_tokens: int) -> str | None:
    try:
        tokens = count_tokens(example)
    except ExampleError as exc:
        return str(exc)
    if tokens > max_tokens:
        return f"{tokens} tokens, longer than the model's context of {max_tokens} tokens"
    return None


def parse_dataset(
    data: bytes,
    min_examples: int,
    count_tokens: Callable[[Example], int] | None = None,
    max_tokens: int | None = None,
) -> Dataset:
    """Check every line; report up to MAX_REPORTED_ERRORS problems with their line numbers."""
    text, problem = _decode(data)
    if text is None:
        return Dataset(problem=problem)
    if not text.strip():
        return Dataset(problem="the file is empty")
    dataset, bad_lines = Dataset(), 0
    for number, line in _numbered_lines(text):
        if not line.strip():
            continue  # blank lines (a trailing newline, say) are harmless
        example, error = parse_example(line, max_tokens)
        if example is not None and count_tokens is not None and max_tokens is not None:
            error = _token_problem(example, count_tokens, max_tokens)
        if error:
            bad_lines += 1
            if len(dataset.errors) < MAX_REPORTED_ERRORS:
                dataset.errors.append(LineError(number, error))
            continue
        assert example is not None  # parse_example gives an example or an error, never neither
        dataset.examples.append(example)
        dataset.lines.append(number)
    if bad_lines > len(dataset.errors):
        dataset.problem = f"{bad_lines} lines have problems; the first {len(dataset.errors)} are listed"
    elif not dataset.errors and len(dataset.examples) < min_examples:
        dataset.problem = f"needs at least {min_examples} examples, found {len(dataset.examples)}"
    return dataset
