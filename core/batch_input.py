"""Batch input files: JSONL request lines, as OpenAI's Batch API takes them, checked line by line.

Each line is ``{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions", "body": {...}}``
(or ``"url": "/v1/completions"``, ``"/v1/responses"``: each line is answered at its own url).
The envelope is checked here, at upload and again when a worker reads the file: plain JSON only
(``core.strict_json``: no NaN or Infinity, no integer past 64 bits, no deep nesting, no NUL), an
object with exactly those four fields, a ``custom_id`` no other line has, a ``body`` that is an object
naming its ``model``. What the body asks for (its fields, the caps, whether the caller may use the
model) is the gateway's business, checked per line when the line runs: a line refused there goes to
the batch's error file and the batch goes on (as OpenAI's does).

Memory is bounded whatever the file: it is read a line at a time, a line over ``MAX_LINE_BYTES`` is
skipped unread, and duplicates are found through a 16-byte digest per custom_id, not the ids.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from core import strict_json
from core.datasets import LineError
from core.jsonl_lines import LineProblems, nonblank_lines  # the one JSONL line reader

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")  # a line's "url", a batch's "endpoint"
ENVELOPE = ("custom_id", "method", "url", "body")
MAX_LINES = 50_000  # OpenAI's limit on a batch's requests
MAX_LINE_BYTES = 1024 * 1024  # a chat request's body within the gateway's caps fits easily
MAX_CUSTOM_ID_CHARS = 512


@dataclass(frozen=True)
class BatchRequest:
    line: int  # the file's line number, from 1
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass
class BatchFile:
    """What checking a whole file found: the requests counted, and up to MAX_REPORTED_ERRORS problems."""

    request_count: int = 0
    prompt_tokens: int = 0  # its requests' prompts, as ``check_batch_file``'s caller estimates them
    errors: list[LineError] = field(default_factory=list)
    problem: str | None = None  # a whole-file problem (empty, not UTF-8, too many lines)

    @property
    def ok(self) -> bool:
        return self.problem is None and not self.errors


def parse_line(text: str, line: int) -> tuple[BatchRequest | None, str | None]:
    """One line's request, or what is wrong with its envelope."""
    try:
        record = strict_json.loads(text)
    except strict_json.JsonRefused as exc:
        return None, exc.detail
    if not isinstance(record, dict):
        return None, 'must be a JSON object with "custom_id", "method", "url" and "body"'
    for name in record:
        if name not in ENVELOPE:
            return None, f"unknown field '{name[:64]}': a line has only {', '.join(ENVELOPE)}"
    custom_id, method, url, body = (record.get(name) for name in ENVELOPE)
    if not isinstance(custom_id, str) or not custom_id:
        return None, "custom_id must be a non-empty string"
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return None, f"custom_id is {len(custom_id):,} characters, more than {MAX_CUSTOM_ID_CHARS}"
    if method != "POST":
        return None, 'method must be "POST"'
    if url not in ENDPOINTS:
        return None, f"url must be one of {', '.join(ENDPOINTS)}"
    if not isinstance(body, dict):
        return None, "body must be a JSON object: the request as it would be sent to url"
    if not isinstance(body.get("model"), str) or not body["model"]:
        return None, "body.model must name the model that answers"
    if body.get("stream") not in (None, False):
        return None, "body.stream: a batch's answers are whole answers; leave stream out"
    return BatchRequest(line, custom_id, url, body), None


def _digest(custom_id: str) -> bytes:
    return hashlib.blake2b(custom_id.encode(), digest_size=16).digest()


def _lines(source: BinaryIO) -> Iterator[tuple[int, BatchRequest | None, str | None]]:
    """Each non-blank line's request or problem; (0, None, problem) ends it for a whole-file problem."""
    seen: dict[bytes, int] = {}  # a custom_id's digest -> the line that has it
    too_many = f"more than {MAX_LINES:,} requests: split the file into several batches"
    for number, text, problem in nonblank_lines(source, MAX_LINE_BYTES, MAX_LINES, too_many):
        if text is None:
            yield number, None, problem
            if number == 0:
                return
            continue
        request, error = parse_line(text, number)
        if request is not None:
            first = seen.setdefault(_digest(request.custom_id), number)
            if first != number:
                error = f"custom_id '{request.custom_id[:64]}' is also on line {first}: each must be unique"
                request = None
        yield number, request, error


def check_batch_file(source: bytes | BinaryIO, prompt_tokens: Callable[[BatchRequest], int] = lambda _: 0) -> BatchFile:
    """Check every line; report up to MAX_REPORTED_ERRORS problems with their line numbers.
    ``prompt_tokens``: a request's prompt tokens, summed over the file's requests."""
    stream = io.BytesIO(source) if isinstance(source, bytes) else source
    checked, problems = BatchFile(), LineProblems()
    for number, request, error in _lines(stream):
        if number == 0:
            return BatchFile(problem=error)
        if error is not None:
            problems.add(number, error)
        elif request is not None:
            checked.request_count += 1
            checked.prompt_tokens += prompt_tokens(request)
    checked.errors, checked.problem = problems.errors, problems.summary(checked.request_count, "the file is empty")
    return checked


def read_requests(source: BinaryIO) -> Iterator[BatchRequest]:
    """The requests of a file that passed ``check_batch_file`` (the worker reads it again); a line
    that no longer passes raises ValueError, as the file changed under its id."""
    for number, request, error in _lines(source):
        if request is None:
            raise ValueError(f"line {number}: {error}" if number else str(error))
        yield request
