"""Scoring answers against a held-out file: the graders an evaluation gate runs (pure functions).

Each example of the file is a conversation; its last assistant message is the expected answer and
what comes before it is the prompt. A grader says whether one answer passes:
- ``exact_match``: the answer is the expected one (surrounding whitespace aside);
- ``contains``: the expected answer appears in the answer;
- ``regex``: ``pattern`` matches somewhere in the answer (the expected answer is not used);
- ``json_schema``: the answer is JSON valid against ``schema``.
(OpenAI's graders are ``core.graders``'.) An example scores the mean of its graders' scores (1 or 0
for these: the share it passes); a model scores the mean over examples.

The tenant writes the pattern and the schema, so neither is trusted. A regex runs with the ``regex``
package's time limit (Python's ``re`` has none, and ``(a|a)+$`` takes it hours); a schema is bounded
in size and depth, and may point only inside itself (``#...``): a remote ``$ref`` is refused when the
job is created (``grader_problem``), and never fetched when grading (a registry that retrieves
nothing). Neither limit covers everything (a schema's ``pattern`` keyword runs Python's ``re``), so
these graders run in a separate process with a wall-clock limit (``core.grading``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import jsonschema
import regex  # type: ignore[import-untyped]
from referencing import Registry
from referencing.exceptions import NoSuchResource, Unresolvable

from core.datasets import Example

GRADERS = ("exact_match", "contains", "regex", "json_schema")  # the platform's own
SANDBOXED = ("regex", "json_schema")  # the graders that run the tenant's pattern or schema
REGEX_TIMEOUT_S = 1.0  # the regex package's own limit (checked now and then, so it can overshoot)
MAX_ANSWER_CHARS = 20_000  # a longer answer fails these graders unread (answers are short: MAX_ANSWER_TOKENS)
MAX_SCHEMA_BYTES = 16 * 1024  # of the schema as JSON
MAX_SCHEMA_DEPTH = 16  # objects and lists inside one another
_REFERENCE_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")


@dataclass(frozen=True)
class Grader:
    type: str
    pattern: str | None = None  # regex
    schema: dict | None = field(default=None, hash=False)  # json_schema

    @classmethod
    def of(cls, kept: dict) -> Grader:
        """The grader of one of the platform's graders as an eval or a job keeps it (a dict)."""
        return cls(kept["type"], kept.get("pattern"), kept.get("schema"))


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
    """Whether ``answer`` passes; a regex over its time limit raises ``TimeoutError``. Run the
    ``SANDBOXED`` graders through ``core.grading``, not directly, in a process that must not stall."""
    if grader.type == "exact_match":
        return answer.strip() == expected.strip()
    if grader.type == "contains":
        return expected.strip() in answer
    if len(answer) > MAX_ANSWER_CHARS:
        return False
    if grader.type == "regex":
        assert grader.pattern is not None
        # concurrent: the GIL is released while it matches, so the process's other threads run on.
        return regex.search(grader.pattern, answer, timeout=REGEX_TIMEOUT_S, concurrent=True) is not None
    if grader.type == "json_schema":
        return _valid_json(grader.schema or {}, answer)
    raise ValueError(f"unknown grader {grader.type!r}")


def _refuse(uri: str) -> object:
    raise NoSuchResource(ref=uri)  # type: ignore[call-arg]  # (an attrs class: mypy sees no fields)


# Every schema is validated with this registry: a reference it cannot resolve within the schema is an
# error (the answer fails), never a request to wherever the tenant pointed it.
_NO_RETRIEVAL: Registry = Registry(retrieve=_refuse)  # type: ignore[call-arg]


def invalid_item(schema: dict, items: list[object]) -> tuple[int, str, str] | None:
    """The first of ``items`` that ``schema`` refuses: (its index, the dotted path of the value at
    fault, the validator's message, cut to 200 characters)."""
    validator = jsonschema.Draft202012Validator(schema, registry=_NO_RETRIEVAL)
    for index, item in enumerate(items):
        error = jsonschema.exceptions.best_match(validator.iter_errors(item))
        if error is not None:
            return index, ".".join(str(part) for part in error.absolute_path), error.message[:200]
    return None


def _valid_json(schema: dict, answer: str) -> bool:
    try:
        instance = json.loads(answer)
        return bool(jsonschema.Draft202012Validator(schema, registry=_NO_RETRIEVAL).is_valid(instance))
    except (ValueError, RecursionError, jsonschema.SchemaError, Unresolvable):
        return False  # not JSON, nested too deep, or a reference to outside the schema: a fail


def share_passed(scores: list[float]) -> float:
    """One case's score: the mean of its graders' scores (a pass/fail grader's is 1 or 0: the share it passes)."""
    return sum(scores) / len(scores) if scores else 0.0


def mean_score(per_case: list[list[float]]) -> float:
    """A model's score: the mean over cases of each one's score (0 without cases)."""
    return sum(share_passed(scores) for scores in per_case) / len(per_case) if per_case else 0.0


def grader_problem(grader: Grader) -> tuple[str, str] | None:
    """What is wrong with a tenant's grader, as (its field, a message saying what to fix), checked
    when the job is created so that nothing is queued that could not grade."""
    if grader.type == "regex":
        if grader.pattern is None:
            return "pattern", "a regex grader needs a pattern"
        try:
            regex.compile(grader.pattern)
        except (regex.error, OverflowError, RecursionError) as exc:
            return "pattern", f"not a regular expression: {exc}"
    if grader.type == "json_schema":
        if grader.schema is None:
            return "schema", "a json_schema grader needs a schema"
        return _schema_problem(grader.schema)
    return None


def _schema_problem(schema: dict) -> tuple[str, str] | None:
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        return "schema", f"nested {depth} levels deep, more than the {MAX_SCHEMA_DEPTH} allowed"
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_BYTES:
        return "schema", f"{size:,} bytes of JSON, more than the {MAX_SCHEMA_BYTES:,} allowed"
    for path, reference in _references(schema):
        if not reference.startswith("#"):
            return path, (
                f"{reference[:100]!r} points outside the schema; graders fetch nothing, so only references "
                'within it ("#/$defs/...") are allowed: copy what it points at into the schema\'s $defs'
            )
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        return "schema", f"not a JSON Schema: {exc.message}"
    return None


def _depth(value: object) -> int:
    """How deep objects and lists nest (iteratively: a deep one must not exhaust the stack)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            pending.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _references(schema: dict) -> Iterator[tuple[str, str]]:
    """Every reference keyword with a string value, as (its path, its value)."""
    pending: list[tuple[str, object]] = [("schema", schema)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                if key in _REFERENCE_KEYWORDS and isinstance(child, str):
                    yield f"{path}.{key}", child
                else:
                    pending.append((f"{path}.{key}", child))
        elif isinstance(item, list):
            pending.extend((f"{path}[{index}]", child) for index, child in enumerate(item))
