"""Scoring answers against a held-out file: the graders an evaluation gate runs (pure functions).

Each example of the file is a conversation; its last assistant message is the expected answer and
what comes before it is the prompt. A grader says whether one answer passes:
- ``exact_match``: the answer is the expected one (surrounding whitespace aside);
- ``contains``: the expected answer appears in the answer;
- ``regex``: ``pattern`` matches somewhere in the answer (the expected answer is not used);
- ``json_schema``: the answer is JSON valid against ``schema``.
An example scores the share of graders it passes; a model scores the mean over examples.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from core.datasets import Example

GRADERS = ("exact_match", "contains", "regex", "json_schema")


@dataclass(frozen=True)
class Grader:
    type: str
    pattern: str | None = None  # regex
    schema: dict | None = field(default=None, hash=False)  # json_schema


@dataclass(frozen=True)
class Case:
    prompt: list[dict]  # the messages before the expected answer
    expected: str


def cases_of(examples: list[Example], limit: int) -> list[Case]:
    """The first ``limit`` examples that end with an assistant's answer, as prompts and answers."""
    cases: list[Case] = []
    for messages in examples:
        if len(cases) == limit:
            break
        if len(messages) >= 2 and messages[-1]["role"] == "assistant":
            prompt = [{"role": m["role"], "content": m["content"]} for m in messages[:-1]]
            cases.append(Case(prompt, messages[-1]["content"]))
    return cases


def passes(grader: Grader, answer: str, expected: str) -> bool:
    if grader.type == "exact_match":
        return answer.strip() == expected.strip()
    if grader.type == "contains":
        return expected.strip() in answer
    if grader.type == "regex":
        assert grader.pattern is not None
        return re.search(grader.pattern, answer) is not None
    if grader.type == "json_schema":
        import jsonschema

        try:
            jsonschema.validate(json.loads(answer), grader.schema or {})
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    raise ValueError(f"unknown grader {grader.type!r}")


def score(graders: list[Grader], answers: list[str], cases: list[Case]) -> float:
    """The mean over cases of the share of graders each answer passes (0 to 1)."""
    if not cases:
        return 0.0
    per_case = [sum(passes(g, answer, case.expected) for g in graders) / len(graders) for answer, case in zip(answers, cases)]
    return sum(per_case) / len(per_case)
