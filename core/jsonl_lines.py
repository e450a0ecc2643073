"""A JSONL file's non-blank lines, one at a time, for the files checked line by line that are not
datasets (batch requests, eval items): a line over its byte cap skipped unread, the file's encoding
and its line count checked, and the problems of a whole check gathered as a dataset's are (up to
MAX_REPORTED_ERRORS, each with its line number)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from core.datasets import MAX_REPORTED_ERRORS, LineError, decoded_line, numbered_lines


def nonblank_lines(source: BinaryIO, max_line_bytes: int, max_lines: int, too_many: str) -> Iterator[tuple[int, str | None, str | None]]:
    """(line number, text, None) for each non-blank line, (line number, None, problem) for one over
    ``max_line_bytes``; (0, None, problem) ends it for a whole-file problem: not UTF-8, or more than
    ``max_lines`` lines (the problem is then ``too_many``)."""
    count = 0
    for number, raw in numbered_lines(source, max_line_bytes):
        if raw is None:
            yield number, None, f"the line is over {max_line_bytes:,} bytes"
            continue
        text, problem = decoded_line(raw, number)
        if text is None:
            yield 0, None, problem
            return
        if not text.strip():
            continue
        count += 1
        if count > max_lines:
            yield 0, None, too_many
            return
        yield number, text, None


@dataclass
class LineProblems:
    """What a check of every line found wrong: the first MAX_REPORTED_ERRORS lines' problems, and how many there were."""

    errors: list[LineError] = field(default_factory=list)
    bad_lines: int = 0

    def add(self, number: int, problem: str) -> None:
        self.bad_lines += 1
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(LineError(number, problem))

    def summary(self, good_lines: int, empty: str) -> str | None:
        """The whole file's problem, if any: ``empty`` when it has no line at all, or how many of its
        lines have problems when more than are listed."""
        if good_lines == 0 and not self.bad_lines:
            return empty
        if self.bad_lines > len(self.errors):
            return f"{self.bad_lines} lines have problems; the first {len(self.errors)} are listed"
        return None
