"""Grading with a tenant's pattern or schema, in a process of its own with a wall-clock limit.

A trainer grades the evaluation gate's answers while its heartbeat thread (``workers.heartbeat``)
keeps the job claimed. A pattern or a schema that takes minutes to match must not stop that thread
(Python's ``re`` and ``jsonschema``'s ``pattern`` keyword hold the GIL while they match), nor hold
the trainer: so each answer is graded by a child process (``python -m core.grading``) that is
killed when it takes longer than GRADE_TIMEOUT_S, and started again for the next answer. An answer
whose grading timed out fails that grader; once a grader has timed out MAX_TIMEOUTS_PER_GRADER
times, it fails the remaining answers without running, so an evaluation's grading time is bounded.

The child gets no environment (no credentials), a memory limit, and one JSON line per answer on
stdin: ``{"grader": {...}, "answer": "..."}``; it answers a line ``{"verdict": "pass"|"fail"|"timeout"}``.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from types import TracebackType
from typing import Self

from core.evaluation import MAX_ANSWER_CHARS, SANDBOXED, Grader, passes

GRADE_TIMEOUT_S = 5.0  # one answer and one grader, the child's start included
MAX_TIMEOUTS_PER_GRADER = 3
MEMORY_LIMIT_BYTES = 1 << 30  # the child's address space
_PROJECT_ROOT = Path(__file__).resolve().parents[1]
PASS, FAIL, TIMEOUT = "pass", "fail", "timeout"


class GradingSandbox:
    """``passes`` as ``core.evaluation.score`` calls it, for any grader; the tenant's graders run in
    the child. ``timeouts`` counts, per grader, the answers it failed for time: over the limit, or not
    run after MAX_TIMEOUTS_PER_GRADER answers over it."""

    def __init__(self, timeout_s: float | None = None):
        self.timeout_s = GRADE_TIMEOUT_S if timeout_s is None else timeout_s
        self.timeouts: Counter[Grader] = Counter()
        self._child: subprocess.Popen[bytes] | None = None
        self._pending = b""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._stop()

    def passes(self, grader: Grader, answer: str, expected: str) -> bool:
        if grader.type not in SANDBOXED:
            return passes(grader, answer, expected)  # the platform's own string comparisons
        if len(answer) > MAX_ANSWER_CHARS:
            return False  # not worth sending
        if self.timeouts[grader] >= MAX_TIMEOUTS_PER_GRADER:
            self.timeouts[grader] += 1
            return False
        verdict = self._ask({"grader": asdict(grader), "answer": answer})
        if verdict == TIMEOUT:
            self.timeouts[grader] += 1
        return verdict == PASS

    def _ask(self, request: dict) -> str:
        deadline = time.monotonic() + self.timeout_s
        child = self._started()
        try:
            assert child.stdin is not None
            child.stdin.write(json.dumps(request).encode() + b"\n")
            child.stdin.flush()
            line = self._line(child, deadline)
        except OSError:  # the child died (its memory limit, say): that answer fails
            self._stop()
            return FAIL
        if line is None:
            self._stop()  # killed mid-match: the next answer gets a fresh child
            return TIMEOUT
        return str(json.loads(line)["verdict"])

    def _line(self, child: subprocess.Popen[bytes], deadline: float) -> bytes | None:
        """The child's next line, or None when it does not come before ``deadline``."""
        assert child.stdout is not None
        descriptor = child.stdout.fileno()
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([descriptor], [], [], remaining)[0]:
                return None
            chunk = os.read(descriptor, 65536)
            if not chunk:
                raise OSError("the grading process ended")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line

    def _started(self) -> subprocess.Popen[bytes]:
        if self._child is None:
            self._child = subprocess.Popen(
                [sys.executable, "-m", "core.grading"], cwd=_PROJECT_ROOT, env={"PYTHONDONTWRITEBYTECODE": "1"},
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0,
            )  # fmt: skip
            self._pending = b""
        return self._child

    def _stop(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            for stream in (self._child.stdin, self._child.stdout):
                if stream is not None:
                    stream.close()
            self._child = None


def describe(grader: Grader) -> str:
    """A grader as a job's events name it."""
    if grader.type == "regex":
        return f"regex grader {(grader.pattern or '')[:80]!r}"
    return f"{grader.type} grader"


def _verdict(request: dict) -> str:
    try:
        return PASS if passes(Grader(**request["grader"]), request["answer"], "") else FAIL
    except TimeoutError:
        return TIMEOUT
    except Exception:  # noqa: BLE001  # a grader that cannot run fails the answer; it never ends the child
        return FAIL


def _serve() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    for line in sys.stdin.buffer:
        sys.stdout.write(json.dumps({"verdict": _verdict(json.loads(line))}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
