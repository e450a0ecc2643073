"""Training data: parse and check a JSONL upload line by line, before anything is stored or queued.

Three line shapes are accepted, as in OpenAI's fine-tuning API:
- chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": "...", "weight": 0|1}, ...]}``, with
  function calling as OpenAI writes it: ``tools`` beside ``messages``, assistant ``tool_calls`` and ``tool``
  messages (``core.tool_calls`` checks them), and ``parallel_tool_calls``.
- prompt/completion: ``{"prompt": "...", "completion": "..."}``, trained as one user turn and one
  assistant turn.
- preference (for DPO): ``{"input": {"messages": [...], "tools": [...]?}, "preferred_output": [{"role":
  "assistant", "content": "..."}], "non_preferred_output": [{"role": "assistant", "content": "..."}]}``.
- prompts (for reinforcement fine-tuning): ``{"messages": [...], <any other fields>}`` with no assistant
  message: the model answers the conversation, and a grader reads the answer beside the line's other
  fields (``{{item.reference_answer}}``), as in OpenAI's reinforcement fine-tuning.
A file holds one of chat (and prompt/completion), preference or prompts lines: its ``format``.
Every problem names its line, so a person can fix the file in one pass. Whatever the bytes, a line
gets an example or an error, never an exception: the upload answers 400 with the line, not 500.
The file is read a line at a time, and a line longer than the model's context could hold is skipped
unread, so checking a file takes memory for one line, not for the file.
"""

from __future__ import annotations

import io
import itertools
import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from core.tool_calls import Tool, checked_tool_calls, checked_tools

ROLES = ("system", "user", "assistant", "tool")
MAX_REPORTED_ERRORS = 20

# JSON nested deeper than this is refused before it is parsed: a chat line needs 3 levels ({"messages":
# [{...}]}), a preference line 4, and Python's parser raises RecursionError at about 1,000.
MAX_NESTING_DEPTH = 32
# With the model's context known, a line that could not fit it is refused before it is parsed or
# tokenized (tokenizing is the slow step: 0.13 s for 140 KB). The caps scale with the context, so a
# model with a longer one gets longer lines, and they are loose on purpose: no line that fits is refused.
MAX_CHARS_PER_TOKEN = 128  # of the JSON line; SmolLM2's longest token is 82 characters, real text is 3-12
MIN_TOKENS_PER_MESSAGE = 2  # any chat template spends at least a role marker and an end-of-turn on a message
MAX_UTF8_BYTES_PER_CHAR = 4
_SKIP_CHUNK_BYTES = 1024 * 1024  # the rest of a line too long to read is skipped this much at a time

# {"role", "content": str, "weight": 0|1}; an assistant's calls add "tool_calls" (its content may then be
# None), a tool message "tool_call_id" (core.tool_calls)
Message = dict
# Conversations with tools are located message by message (``core.chat_tokens``), a rendering each: their
# replies are capped so a line costs a bounded time to check.
MAX_REPLIES_WITH_TOOLS = 64


class Example(list[Message]):
    """A conversation: its messages in order, and the tools its line declares (OpenAI's top-level
    ``tools``), which the chat template renders into the prompt as serving does."""

    def __init__(self, messages: Iterable[Message] = (), tools: list[Tool] | None = None):
        super().__init__(messages)
        self.tools = tools

    @property
    def calls_tools(self) -> bool:
        """Whether rendering it involves tools: declared ones, calls, or their results."""
        return bool(self.tools) or any(message.get("tool_calls") or message["role"] == "tool" for message in self)

# A file's format: what its lines hold, and so which fine-tuning method can train on it.
CHAT = "chat"  # {"messages"} or {"prompt", "completion"} lines: supervised fine-tuning
PREFERENCE = "preference"  # {"input", "preferred_output", "non_preferred_output"} lines: DPO
PROMPTS = "prompts"  # {"messages"} lines without an assistant message, and fields for the grader: reinforcement
FORMAT_SHAPES = {
    CHAT: '{"messages"} or {"prompt", "completion"}',
    PREFERENCE: '{"input", "preferred_output", "non_preferred_output"}',
    PROMPTS: '{"messages"} without an assistant message, and the fields your grader reads',
}
PREFERENCE_KEYS = ("input", "preferred_output", "non_preferred_output")


@dataclass(frozen=True)
class PreferencePair:
    """One preference line: a prompt and two answers to it, the preferred one and the other.

    The prompt's assistant messages (earlier turns) have weight 0: they are context, and only the two
    answers are scored. ``chosen`` and ``rejected`` are the two conversations as chat examples, so they
    are rendered, tokenized and masked exactly as a chat line is (``core.chat_tokens``).
    """

    prompt: list[Message]
    preferred: Message  # an assistant message, weight 1
    non_preferred: Message
    tools: list[Tool] | None = None  # the input's tools, declared to both answers

    @property
    def chosen(self) -> Example:
        return Example([*self.prompt, self.preferred], tools=self.tools)

    @property
    def rejected(self) -> Example:
        return Example([*self.prompt, self.non_preferred], tools=self.tools)


@dataclass(frozen=True)
class PromptItem:
    """One prompts line: a conversation for the model to answer, and the whole line as the grader's
    ``item`` (its messages too, as OpenAI's graders see them)."""

    prompt: Example  # no assistant message: what is answered
    item: dict


Record = Example | PreferencePair | PromptItem  # what one line of a file holds


def format_of(record: Record) -> str:
    if isinstance(record, PreferencePair):
        return PREFERENCE
    return PROMPTS if isinstance(record, PromptItem) else CHAT


def as_chat(record: Record) -> Example:
    """A chat example for readers of held-out examples (evaluations, previews): a pair's preferred
    conversation, whose answer is the one to expect; a prompt alone, which has none."""
    if isinstance(record, PreferencePair):
        return record.chosen
    return record.prompt if isinstance(record, PromptItem) else record


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
    examples: list[Record] = field(default_factory=list)  # empty when parsed with keep_examples=False
    lines: list[int] = field(default_factory=list)  # the file line of each example kept
    errors: list[LineError] = field(default_factory=list)
    problem: str | None = None  # a whole-file problem (empty, not UTF-8, too few examples)
    example_count: int = 0
    format: str = CHAT  # its first example's: every other must have the same (CHAT for a file with none)

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


def _too_long(length: str, max_tokens: int) -> str:
    return (
        f"the line is {length} long, more than the {max_line_chars(max_tokens):,} characters allowed "
        f"for the model's context of {max_tokens} tokens: split the conversation over several lines"
    )


def _line_problem(line: str, max_tokens: int | None) -> str | None:
    """What is wrong with a line before it is even parsed."""
    if max_tokens is not None and len(line) > max_line_chars(max_tokens):
        return _too_long(f"{len(line):,} characters", max_tokens)
    if "\x00" in line:
        return "contains NUL bytes (0x00), so the file looks binary or UTF-16: save it as UTF-8 text"
    depth = _nesting_depth(line)
    if depth > MAX_NESTING_DEPTH:
        return f"the JSON is nested {depth:,} levels deep, more than {MAX_NESTING_DEPTH}: a chat line needs 3, a preference line 4"
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


@dataclass
class _Calls:
    """What a conversation's tool messages may answer: the functions its line declares, and the calls made
    and not yet answered."""

    declared: set[str]
    parallel: bool = True
    open: set[str] = field(default_factory=set)


def _message(raw: object, index: int, calls: _Calls) -> tuple[Message | None, str | None]:
    where = f"messages[{index}]"
    if not isinstance(raw, dict):
        return None, f"{where} must be an object with 'role' and 'content'"
    role, content = raw.get("role"), raw.get("content")
    if role not in ROLES:
        return None, f"{where}.role must be one of {', '.join(ROLES)}"
    tool_calls = raw.get("tool_calls")
    if role == "assistant" and tool_calls is not None:
        return _tool_call_message(raw, where, calls)
    if "tool_calls" in raw and role != "assistant":
        return None, f"{where}.tool_calls is only allowed on assistant messages"
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
    if role == "tool":
        return _tool_message(raw, where, content, calls)
    return {"role": role, "content": content, "weight": weight}, None


def _tool_call_message(raw: dict, where: str, calls: _Calls) -> tuple[Message | None, str | None]:
    """An assistant message that calls functions: its content null, absent or text said before the calls."""
    content, weight = raw.get("content"), raw.get("weight", 1)
    if content is not None and not isinstance(content, str):
        return None, f"{where}.content must be a string or null"
    if weight not in (0, 1) or isinstance(weight, bool):
        return None, f"{where}.weight must be 0 or 1"
    tool_calls, error = checked_tool_calls(raw["tool_calls"], f"{where}.tool_calls", calls.declared, calls.parallel)
    if tool_calls is None:
        return None, error
    error = _text_problem(content or "", f"{where}.content") or next(
        filter(None, (_text_problem(call["function"]["arguments"], f"{where}.tool_calls[{i}].function.arguments")
                      for i, call in enumerate(tool_calls))), None,
    )
    if error:
        return None, error
    calls.open |= {call["id"] for call in tool_calls}
    return {"role": "assistant", "content": content, "tool_calls": tool_calls, "weight": weight}, None


def _tool_message(raw: dict, where: str, content: str, calls: _Calls) -> tuple[Message | None, str | None]:
    call_id = raw.get("tool_call_id")
    if not isinstance(call_id, str):
        return None, f"{where}.tool_call_id must be a string: the id of the call this message answers"
    if call_id not in calls.open:
        return None, f"{where}.tool_call_id {call_id!r} answers no call of an earlier assistant message (or one answered already)"
    calls.open.discard(call_id)
    return {"role": "tool", "content": content, "tool_call_id": call_id, "weight": 0}, None


def _chat_messages(
    raw_messages: object, max_tokens: int | None, tools: list[Tool] | None = None, parallel: bool = True
) -> tuple[Example | None, str | None]:
    """A conversation's messages, each checked, opening with a user or system message."""
    if not isinstance(raw_messages, list) or not raw_messages:
        return None, "messages must be a non-empty list"
    if max_tokens is not None and len(raw_messages) > max_messages(max_tokens):
        return None, (
            f"{len(raw_messages):,} messages, more than the {max_messages(max_tokens):,} allowed for the model's "
            f"context of {max_tokens} tokens: split the conversation over several lines"
        )
    calls = _Calls({tool["function"]["name"] for tool in tools or ()}, parallel)
    messages = Example(tools=tools)
    for index, raw in enumerate(raw_messages):
        message, error = _message(raw, index, calls)
        if message is None:
            return None, error
        messages.append(message)
    # A reply is trained after the prompt the conversation before it makes, and a conversation that opens
    # with the assistant has none (the tokenizer refuses to render an empty conversation). A system
    # message alone is a prompt, so a greeting after it stays a valid example.
    if messages[0]["role"] in ("assistant", "tool"):
        return None, f"messages[0] is from the {messages[0]['role']}: start with the user (or system) message it answers"
    replies = sum(message["role"] == "assistant" for message in messages)
    if messages.calls_tools and replies > MAX_REPLIES_WITH_TOOLS:
        return None, (
            f"{replies} assistant messages in a conversation with tools, more than {MAX_REPLIES_WITH_TOOLS}: "
            "split the conversation over several lines"
        )
    return messages, None


def _line_tools(record: dict, where: str = "") -> tuple[list[Tool] | None, bool, str | None]:
    """A line's declared tools (None when it declares none) and whether it allows parallel calls."""
    parallel = record.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        return None, True, f"{where}parallel_tool_calls must be true or false"
    if "tools" not in record:
        return None, parallel, None
    tools, error = checked_tools(record["tools"], f"{where}tools")
    return tools, parallel, error


def _chat_example(record: dict, max_tokens: int | None) -> tuple[Example | PromptItem | None, str | None]:
    """A chat example; without an assistant message, a prompt (for reinforcement fine-tuning)."""
    tools, parallel, error = _line_tools(record)
    if error:
        return None, error
    messages, error = _chat_messages(record["messages"], max_tokens, tools, parallel)
    if messages is None:
        return None, error
    assistant = [m for m in messages if m["role"] == "assistant"]
    if not assistant:
        return PromptItem(messages, record), None
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
    return Example([
        {"role": "user", "content": prompt, "weight": 1},
        {"role": "assistant", "content": completion, "weight": 1},
    ]), None


def _answer(raw: object, where: str, tools: list[Tool] | None) -> tuple[Message | None, str | None]:
    """A preference answer: a list of one assistant message, as OpenAI's preference lines hold it (its
    content, or calls of the input's tools)."""
    if not isinstance(raw, list) or len(raw) != 1:
        return None, f'{where} must be a list of one message, [{{"role": "assistant", "content": "..."}}]'
    message, error = _message(raw[0], 0, _Calls({tool["function"]["name"] for tool in tools or ()}))
    if message is None:
        return None, (error or "").replace("messages[0]", f"{where}[0]", 1)
    if message["role"] != "assistant":
        return None, f"{where}[0].role must be assistant: it is the answer to the input's messages"
    if "weight" in raw[0]:
        return None, f"{where}[0].weight is not allowed: both answers of a pair are always scored"
    return message, None


def _preference_example(record: dict, max_tokens: int | None) -> tuple[PreferencePair | None, str | None]:
    missing = [key for key in PREFERENCE_KEYS if key not in record]
    if missing:
        return None, f"a preference line needs {', '.join(PREFERENCE_KEYS)}; {', '.join(missing)} missing"
    raw_input = record["input"]
    if not isinstance(raw_input, dict) or "messages" not in raw_input:
        return None, 'input must be an object with "messages" (and optionally "tools")'
    tools, parallel, error = _line_tools(raw_input, "input.")
    if error:
        return None, error
    prompt, error = _chat_messages(raw_input["messages"], max_tokens, tools, parallel)
    if prompt is None:
        return None, f"input.{error}" if (error or "").startswith("messages") else error
    if prompt[-1]["role"] == "assistant":
        return None, "input.messages ends with an assistant message: the input is the prompt the two answers answer"
    # Earlier replies in the prompt are context: only the two answers are compared.
    context = [{**message, "weight": 0} if message["role"] == "assistant" else message for message in prompt]
    preferred, error = _answer(record["preferred_output"], "preferred_output", tools)
    if preferred is None:
        return None, error
    non_preferred, error = _answer(record["non_preferred_output"], "non_preferred_output", tools)
    if non_preferred is None:
        return None, error
    return PreferencePair(context, preferred, non_preferred, tools), None


def _json_record(line: str) -> tuple[object, str | None]:
    try:
        return json.loads(line), None
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON ({exc.msg} at column {exc.colno})"
    except ValueError:  # not a JSONDecodeError: Python refuses to convert an integer this long
        return None, "has a number with more than 4,300 digits, too long to read"


_SHAPE_KEYS = {
    '"messages"': ("messages",),
    '"prompt"/"completion"': ("prompt", "completion"),
    "input/preferred_output/non_preferred_output": PREFERENCE_KEYS,
}


def parse_example(line: str, max_tokens: int | None = None) -> tuple[Record | None, str | None]:
    """One line's example (a chat example or a preference pair), or what is wrong with it. With
    ``max_tokens``, the model's context, a line too long to fit is refused before it is parsed."""
    error = _line_problem(line, max_tokens)
    if error:
        return None, error
    record, error = _json_record(line)
    if error:
        return None, error
    if not isinstance(record, dict):
        return None, 'must be a JSON object with "messages", or "prompt" and "completion"'
    shapes = [shape for shape, keys in _SHAPE_KEYS.items() if any(key in record for key in keys)]
    if len(shapes) > 1:
        return None, f"use one of {', '.join(shapes)}, not several"
    if shapes == ["input/preferred_output/non_preferred_output"]:
        return _preference_example(record, max_tokens)
    if "messages" in record:
        return _chat_example(record, max_tokens)
    if "prompt" in record or "completion" in record:
        return _completion_example(record)
    return None, 'must have "messages", "prompt" and "completion", or "input", "preferred_output" and "non_preferred_output"'


def numbered_lines(source: BinaryIO, max_bytes: int | None) -> Iterator[tuple[int, bytes | None]]:
    r"""JSONL lines end with "\n", optionally "\r\n". Not str.splitlines(): it also splits at U+2028, U+0085
    and other characters a JSON string may hold as they are, cutting a valid line in two. A line over
    ``max_bytes`` comes as None, its bytes skipped, not read into memory."""
    number = 0
    while line := source.readline(-1 if max_bytes is None else max_bytes + 1):
        number += 1
        if not line.endswith(b"\n") and max_bytes is not None and len(line) > max_bytes:
            while (rest := source.readline(_SKIP_CHUNK_BYTES)) and not rest.endswith(b"\n"):
                pass
            yield number, None
            continue
        yield number, line.removesuffix(b"\n").removesuffix(b"\r")


def decoded_line(line: bytes, number: int) -> tuple[str | None, str | None]:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"the file is not UTF-8 text (line {number} has the byte 0x{line[exc.start]:02x})"
    return (text.removeprefix("\ufeff") if number == 1 else text), None


def _token_problem(record: Record, count_tokens: Callable[[Example], int], max_tokens: int) -> str | None:
    """Each conversation of the line must fit the context: a pair's two (prompt and answer) are counted
    one after the other."""
    conversations = [("preferred_output", record.chosen), ("non_preferred_output", record.rejected)] if (
        isinstance(record, PreferencePair)
    ) else [("", as_chat(record))]
    for which, conversation in conversations:
        try:
            tokens = count_tokens(conversation)
        except ExampleError as exc:
            return str(exc)
        if tokens > max_tokens:
            with_answer = f" (the input with {which})" if which else ""
            return f"{tokens} tokens{with_answer}, longer than the model's context of {max_tokens} tokens"
    return None


def _format_problem(record: Record, dataset: Dataset) -> str | None:
    """A file holds one format, the one of its first example: a line of the other is refused."""
    if not dataset.example_count:
        dataset.format = format_of(record)
        return None
    if format_of(record) == dataset.format:
        return None
    if format_of(record) == PROMPTS and dataset.format == CHAT:  # most likely a reply forgotten
        return "needs at least one assistant message to learn from (a file of prompts alone is for reinforcement fine-tuning)"
    return (
        f"a {format_of(record)} line ({FORMAT_SHAPES[format_of(record)]}) in a file of {dataset.format} lines "
        f"(its first example is one): a file holds one format"
    )


def parse_dataset(
    source: bytes | BinaryIO,
    min_examples: int,
    count_tokens: Callable[[Example], int] | None = None,
    max_tokens: int | None = None,
    keep_examples: bool = True,
    stop_after: int | None = None,
) -> Dataset:
    """Check every line; report up to MAX_REPORTED_ERRORS problems with their line numbers.
    ``keep_examples=False`` only counts them (an upload's check, which must not hold a large file in memory).
    ``stop_after``: return once that many examples are read, the rest of the file unread (a preview)."""
    stream = io.BytesIO(source) if isinstance(source, bytes) else source
    max_bytes = None if max_tokens is None else max_line_chars(max_tokens) * MAX_UTF8_BYTES_PER_CHAR
    dataset, bad_lines, blank = Dataset(), 0, True
    for number, raw in numbered_lines(stream, max_bytes):
        if raw is None:
            assert max_tokens is not None and max_bytes is not None  # lines are cut only for a known context
            error: str | None = _too_long(f"over {max_bytes:,} bytes", max_tokens)
        else:
            line, problem = decoded_line(raw, number)
            if line is None:
                return Dataset(problem=problem)
            if not line.strip():
                continue  # blank lines (a trailing newline, say) are harmless
            example, error = parse_example(line, max_tokens)
            if example is not None and count_tokens is not None and max_tokens is not None:
                error = _token_problem(example, count_tokens, max_tokens)
            if example is not None and not error:
                error = _format_problem(example, dataset)
        blank = False
        if error:
            bad_lines += 1
            if len(dataset.errors) < MAX_REPORTED_ERRORS:
                dataset.errors.append(LineError(number, error))
            continue
        assert example is not None  # parse_example gives an example or an error, never neither
        dataset.example_count += 1
        if keep_examples:
            dataset.examples.append(example)
            dataset.lines.append(number)
        if dataset.example_count == stop_after:
            return dataset
    if blank:
        return Dataset(problem="the file is empty")
    if bad_lines > len(dataset.errors):
        dataset.problem = f"{bad_lines} lines have problems; the first {len(dataset.errors)} are listed"
    elif not dataset.errors and dataset.example_count < min_examples:
        dataset.problem = f"needs at least {min_examples} examples, found {dataset.example_count}"
    return dataset
