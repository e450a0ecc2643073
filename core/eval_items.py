"""An eval's items in OpenAI's shape: ``{"item": {...}, "sample": {...}}``, one per line of a file of
purpose ``evals`` or one per entry of a run's ``file_content``, checked line by line.

``item`` is whatever the eval's ``item_schema`` describes (graders and templates read it as
``{{item.<path>}}``); ``sample`` is optional, a model's answer given in advance (a ``jsonl`` run grades
it as it is; OpenAI's ``{{sample.output_text}}`` and friends). Nothing else may be on a line. Lines
are plain JSON (``core.strict_json``: no NaN, no integer past 64 bits, no deep nesting), at most
MAX_LINE_BYTES each and MAX_LINES a file, read a line at a time, so memory stays bounded.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from collections.abc import Iterator
from typing import Any, BinaryIO

from core import strict_json
from core.datasets import Example, LineError
from core.evaluation import cases_of
from core.jsonl_lines import LineProblems, nonblank_lines

MAX_LINES = 50_000  # a file's items; a run scores the first of them (``evals.sources.MAX_ITEMS``)
MAX_LINE_BYTES = 256 * 1024
FIELDS = ("item", "sample")


@dataclass(frozen=True)
class EvalItem:
    item: dict[str, Any]
    sample: dict[str, Any] | None = None  # given in advance (jsonl runs); None: the model answers

    def entry(self) -> dict[str, Any]:
        """As a file's line or a ``file_content`` entry has it (what ``parsed_entry`` reads)."""
        return {"item": self.item} | ({"sample": self.sample} if self.sample is not None else {})


def chat_items(examples: list[Example], limit: int) -> list[EvalItem]:
    """The items of chat examples (a fine-tuning file's, a job's held-out ones): the first ``limit``
    that end with an assistant's answer, each ``{"input": <the messages before it>, "expected": <it>}``."""
    return [EvalItem({"input": case.prompt, "expected": case.expected}) for case in cases_of(examples, limit)]


@dataclass
class EvalFile:
    """What checking a whole file found: its items counted, and up to MAX_REPORTED_ERRORS problems."""

    item_count: int = 0
    errors: list[LineError] = field(default_factory=list)
    problem: str | None = None  # a whole-file problem (empty, not UTF-8, too many lines)

    @property
    def ok(self) -> bool:
        return self.problem is None and not self.errors


def parsed_entry(entry: object) -> tuple[EvalItem | None, str | None]:
    """One entry's item, or what is wrong with it (``file_content`` entries and file lines alike)."""
    if not isinstance(entry, dict):
        return None, 'must be a JSON object {"item": {...}}, with "sample" optionally'
    for name in entry:
        if name not in FIELDS:
            return None, f"unknown field '{str(name)[:64]}': an entry has only item and sample"
    item, sample = entry.get("item"), entry.get("sample")
    if not isinstance(item, dict):
        return None, "item must be a JSON object: the fields your graders and templates name as {{item.<field>}}"
    if sample is not None:
        if not isinstance(sample, dict):
            return None, "sample must be a JSON object with output_text"
        if not isinstance(sample.get("output_text", ""), str):
            return None, "sample.output_text must be a string: the model's answer"
    return EvalItem(item, sample), None


def parse_line(text: str) -> tuple[EvalItem | None, str | None]:
    try:
        entry = strict_json.loads(text)
    except strict_json.JsonRefused as exc:
        return None, exc.detail
    return parsed_entry(entry)


def _lines(source: BinaryIO, stop_after: int | None = None) -> Iterator[tuple[int, EvalItem | None, str | None]]:
    """Each non-blank line's (number, item, problem); (0, None, problem) ends it for a whole-file problem."""
    too_many = f"more than {MAX_LINES:,} items: split the file into several"
    for count, (number, text, problem) in enumerate(nonblank_lines(source, MAX_LINE_BYTES, MAX_LINES, too_many), start=1):
        if text is None:
            yield number, None, problem
            if number == 0:
                return
            continue
        item, error = parse_line(text)
        yield number, item, error
        if stop_after is not None and count >= stop_after:
            return


def check_eval_file(source: bytes | BinaryIO) -> EvalFile:
    """Check every line; report up to MAX_REPORTED_ERRORS problems with their line numbers."""
    stream = io.BytesIO(source) if isinstance(source, bytes) else source
    checked, problems = EvalFile(), LineProblems()
    for number, item, error in _lines(stream):
        if number == 0:
            return EvalFile(problem=error)
        if error is not None:
            problems.add(number, error)
        elif item is not None:
            checked.item_count += 1
    checked.errors = problems.errors
    checked.problem = problems.summary(checked.item_count, 'the file is empty: give one {"item": {...}} per line')
    return checked


def read_items(source: BinaryIO, limit: int) -> list[EvalItem]:
    """The first ``limit`` items of a file that passed ``check_eval_file`` (read again when a run
    starts); a line that no longer passes raises ValueError: the file changed under its id."""
    found: list[EvalItem] = []
    for number, item, error in _lines(source, stop_after=limit):
        if item is None:
            raise ValueError(f"line {number}: {error}")
        found.append(item)
    return found
