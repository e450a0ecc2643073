"""An eval's testing criteria: OpenAI's ``string_check`` and the platform's own graders
(``exact_match``, ``contains``, ``regex``, ``json_schema``), as ``core.evaluation`` grades them.

Each criterion has a name (the type by default; distinct within an eval), which the run's
``per_testing_criteria_results`` and each output item's ``results`` go by. OpenAI's graders that ask
a model or run code (``label_model``, ``score_model``, ``python``, ``text_similarity``, ``multi``)
are refused by name. A pattern or a schema is checked in ``core.grading``'s sandbox when the eval is
created (nothing else of the tenant's runs in the web process), and graded there on the worker.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.api_errors import ApiError
from core.evaluation import GRADERS, STRING_CHECK, Grader
from core.grading import first_problem

MAX_CRITERIA = 8
NOT_SUPPORTED = ("label_model", "score_model", "python", "text_similarity", "multi")  # OpenAI's, which need a model or code
_NAME = Field(None, min_length=1, max_length=64)


class _Criterion(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str | None = _NAME


class StringCheck(_Criterion):
    type: Literal["string_check"]
    operation: Literal["eq", "ne", "like", "ilike"]
    input: str = Field(max_length=1000)
    reference: str = Field(max_length=1000)


class Comparison(_Criterion):
    type: Literal["exact_match", "contains"]


class Regex(_Criterion):
    type: Literal["regex"]
    pattern: str = Field(min_length=1, max_length=1000)


class JsonSchema(_Criterion):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


_MODELS: dict[str, type[_Criterion]] = {
    STRING_CHECK: StringCheck, "exact_match": Comparison, "contains": Comparison, "regex": Regex, "json_schema": JsonSchema,
}


def checked_criteria(raw: object) -> list[dict]:
    """The criteria as an eval keeps them (each with its name), or the 400 naming what to fix:
    a malformed or unknown one, one OpenAI has and this platform does not, a pattern or a schema
    the sandbox refuses, two of one name."""
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_CRITERIA:
        raise ApiError(f"testing_criteria must be a list of 1 to {MAX_CRITERIA} graders", param="testing_criteria")
    for index, item in enumerate(raw):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind in NOT_SUPPORTED:
            raise ApiError(
                f"testing_criteria.{index}.type: {kind} graders are not supported here; use string_check, or the "
                f"platform's {', '.join(GRADERS)}", param=f"testing_criteria.{index}.type", code="unsupported_grader",
            )  # fmt: skip
        if not isinstance(kind, str) or kind not in (STRING_CHECK, *GRADERS):
            raise ApiError(
                f"testing_criteria.{index}.type: unknown grader {str(kind)[:40]!r}; use one of "
                f"{', '.join((STRING_CHECK, *GRADERS))}", param=f"testing_criteria.{index}.type", code="unknown_grader",
            )  # fmt: skip
    parsed = [_parsed(index, _MODELS[item["type"]], item) for index, item in enumerate(raw)]
    kept = [_kept(criterion) for criterion in parsed]
    _check_names(kept)
    problem = first_problem([grader_of(criterion) for criterion in kept])  # in the sandbox's process
    if problem is not None:
        index, field, message = problem
        param = f"testing_criteria.{index}.{field}"
        raise ApiError(f"{param}: {message}", param=param, code="invalid_grader")
    return kept


def _parsed(index: int, model: type[_Criterion], item: dict) -> _Criterion:
    try:
        return model.model_validate(item)
    except ValidationError as exc:
        problem = exc.errors()[0]
        param = ".".join(["testing_criteria", str(index), *(str(part) for part in problem.get("loc", ()))])
        raise ApiError(f"{param}: {problem['msg']}", param=param, code="invalid_grader") from None


def _kept(criterion: _Criterion) -> dict:
    kept = criterion.model_dump(by_alias=True, exclude_none=True)
    return {**kept, "name": criterion.name or kept["type"]}


def _check_names(criteria: list[dict]) -> None:
    seen: set[str] = set()
    for index, criterion in enumerate(criteria):
        if criterion["name"] in seen:
            raise ApiError(
                f"testing_criteria.{index}.name: another grader is named {criterion['name']!r}; give each a name of its own",
                param=f"testing_criteria.{index}.name", code="duplicate_grader_name",
            )  # fmt: skip
        seen.add(criterion["name"])


def grader_of(criterion: dict) -> Grader:
    """The grader ``core.evaluation`` runs for a kept criterion."""
    fields = ("pattern", "schema", "operation", "input", "reference")
    return Grader(criterion["type"], **{field: criterion[field] for field in fields if field in criterion})
