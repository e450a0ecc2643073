"""Grading with a tenant's pattern or schema, in a process of its own with a wall-clock limit.

A trainer grades the evaluation gate's answers while its heartbeat thread (``workers.heartbeat``)
keeps the job claimed. A pattern or a schema that takes minutes to match must not stop that thread
(Python's ``re`` and ``jsonschema``'s ``pattern`` keyword hold the GIL while they match), nor hold
the trainer: so each answer is graded by a child process (``python -m core.grading``) that is
killed when it takes longer than GRADE_TIMEOUT_S, and started again for the next answer. An answer
whose grading timed out fails that grader; once a grader has timed out MAX_TIMEOUTS_PER_GRADER
times, it fails the remaining answers without running, so an evaluation's grading time is bounded.

Checking a grader when a job is created runs there too (``first_problem``): compiling a pattern
can take gigabytes, which the web process must never spend.

The child gets no environment (no credentials), a memory limit, and one JSON line per request on
stdin: ``{"grade": {...}, "answer": "..."}``, answered ``{"verdict": "pass"|"fail"|"timeout"}``, or
``{"check": {...}}``, answered ``{"problem": null | [field, message]}``, or ``{"validate": {"schema",
"items"}}`` (an eval's items against its item schema), answered ``{"invalid": null | [index, path,
message]}``; ``{}`` when it failed.
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

from core.evaluation import GRADERS, MAX_ANSWER_CHARS, SANDBOXED, Grader, grader_problem, invalid_item, passes

GRADE_TIMEOUT_S = 5.0  # one answer and one grader, the child's start included
MAX_TIMEOUTS_PER_GRADER = 3
MEMORY_LIMIT_BYTES = 1 << 30  # the child's address space
_PROJECT_ROOT = Path(__file__).resolve().parents[1]
PASS, FAIL, TIMEOUT = "pass", "fail", "timeout"


class GradingSandbox:
    """``passes`` as ``core.evaluation.verdicts`` calls it, for any grader; the tenant's graders run in
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
        answer_of_child = self._ask({"grade": asdict(grader), "answer": answer})
        verdict = TIMEOUT if answer_of_child is None else answer_of_child.get("verdict")  # None: the child failed
        if verdict == TIMEOUT:  # killed at the wall-clock limit, or stopped by the regex's own
            self.timeouts[grader] += 1
        return verdict == PASS

    def problem(self, grader: Grader) -> tuple[str, str] | None:
        """``core.evaluation.grader_problem``, found in the child: compiling a pattern can take
        gigabytes (``(((a{100}){100}){100}){100}`` does in ``regex``) or minutes."""
        if grader.type not in SANDBOXED:
            return grader_problem(grader)
        answer_of_child = self._ask({"check": asdict(grader)})
        if answer_of_child is None or "problem" not in answer_of_child:
            field = "pattern" if grader.type == "regex" else "schema"
            limits = f"{self.timeout_s:g} s and {MEMORY_LIMIT_BYTES >> 20} MB"
            return field, f"could not be compiled within {limits}: make it simpler"
        problem = answer_of_child["problem"]
        return None if problem is None else (str(problem[0]), str(problem[1]))

    def _ask(self, request: dict) -> dict | None:
        """The child's answer to ``request``; None when it took longer than the limit (the child is
        killed: the next request starts another), ``{}`` when the child died."""
        deadline = time.monotonic() + self.timeout_s
        child = self._started()
        try:
            assert child.stdin is not None
            child.stdin.write(json.dumps(request).encode() + b"\n")
            child.stdin.flush()
            line = self._line(child, deadline)
        except OSError:  # the child died
            self._stop()
            return {}
        if line is None:
            self._stop()  # killed mid-match: the next answer gets a fresh child
            return None
        return dict(json.loads(line))

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
            )
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


def first_problem(graders: list[Grader]) -> tuple[int, str, str] | None:
    """The first grader that could not grade, as (its index, its field, what to fix), each checked
    in the child (``GradingSandbox.problem``): a job's graders, before it is created."""
    with GradingSandbox(timeout_s=GRADE_TIMEOUT_S) as sandbox:
        for index, grader in enumerate(graders):
            problem = sandbox.problem(grader)
            if problem is not None:
                return index, *problem
    return None


def first_own_problem(criteria: list[dict]) -> tuple[int, str, str] | None:
    """``first_problem`` over the platform's own graders among ``criteria`` (graders as an eval or a
    job keeps them, OpenAI's among them), with the index in ``criteria`` of the one at fault."""
    own = [(index, criterion) for index, criterion in enumerate(criteria) if criterion["type"] in GRADERS]
    problem = first_problem([Grader.of(criterion) for _index, criterion in own])
    if problem is None:
        return None
    position, field, message = problem
    return own[position][0], field, message


def first_invalid_item(schema: dict, items: list[dict]) -> tuple[int, str, str] | None:
    """The first item ``schema`` (a tenant's, already checked by ``first_problem``) refuses, as (its
    index, the path inside it, the validator's message); validated in the child, so a schema that
    takes too long fails here (as the first item's problem) instead of stalling the caller."""
    with GradingSandbox(timeout_s=GRADE_TIMEOUT_S) as sandbox:
        answer = sandbox._ask({"validate": {"schema": schema, "items": items}})
    if answer is None or "invalid" not in answer:
        return 0, "", f"the items could not be checked against the schema within {GRADE_TIMEOUT_S:g} s: make it simpler"
    invalid = answer["invalid"]
    return None if invalid is None else (int(invalid[0]), str(invalid[1]), str(invalid[2]))


def _answer(request: dict) -> dict:
    if "validate" in request:
        return {"invalid": invalid_item(request["validate"]["schema"], request["validate"]["items"])}
    if "check" in request:
        return {"problem": grader_problem(Grader(**request["check"]))}
    try:
        return {"verdict": PASS if passes(Grader(**request["grade"]), request["answer"], "") else FAIL}
    except TimeoutError:
        return {"verdict": TIMEOUT}


def _serve() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    for line in sys.stdin.buffer:
        try:
            answer = _answer(json.loads(line))
        except Exception:  # noqa: BLE001  # out of memory, say: no answer, and the child goes on
            answer = {}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
