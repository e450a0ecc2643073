"""An eval's testing criteria: OpenAI's graders (``core.graders``: string_check, text_similarity,
score_model, label_model, multi; python is refused there) and the platform's own (``exact_match``,
``contains``, ``regex``, ``json_schema``, which compare the answer with ``{{item.expected}}``).

Each criterion has a name (the type by default; distinct within an eval), which the run's
``per_testing_criteria_results`` and each output item's ``results`` go by. A model grader's judge
must be a model the caller may use (checked now, and again when a run grades). A pattern or a schema
is checked in ``core.grading``'s sandbox when the eval is created (nothing else of the tenant's runs
in the web process), and graded there on the worker.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from accounts.models import Organization
from answering.access import usable_target
from answering.batch import Target
from core.api_errors import ApiError
from core.evaluation import GRADERS
from core.graders.spec import GRADER_TYPES, checked_grader, judge_models
from core.grading import first_own_problem

MAX_CRITERIA = 8
_NAME = Field(None, min_length=1, max_length=64)


class _Criterion(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str | None = _NAME


class Comparison(_Criterion):
    type: Literal["exact_match", "contains"]


class Regex(_Criterion):
    type: Literal["regex"]
    pattern: str = Field(min_length=1, max_length=1000)


class JsonSchema(_Criterion):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


_MODELS: dict[str, type[_Criterion]] = {"exact_match": Comparison, "contains": Comparison, "regex": Regex, "json_schema": JsonSchema}
KNOWN = (*(kind for kind in GRADER_TYPES if kind != "python"), *GRADERS)


def checked_criteria(organization: Organization, raw: object) -> list[dict]:
    """The criteria as an eval keeps them (each with its name), or the 400 naming what to fix:
    a malformed or unknown one, one this platform does not offer, a judge the caller may not use, a
    pattern or a schema the sandbox refuses, two of one name."""
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_CRITERIA:
        raise ApiError(f"testing_criteria must be a list of 1 to {MAX_CRITERIA} graders", param="testing_criteria")
    kept = [_checked(organization, index, item) for index, item in enumerate(raw)]
    _check_names(kept)
    problem = first_own_problem(kept)  # in the sandbox's process
    if problem is not None:
        index, field, message = problem
        param = f"testing_criteria.{index}.{field}"
        raise ApiError(f"{param}: {message}", param=param, code="invalid_grader")
    return kept


def _checked(organization: Organization, index: int, item: object) -> dict:
    param = f"testing_criteria.{index}"
    kind = item.get("type") if isinstance(item, dict) else None
    if isinstance(kind, str) and kind in GRADER_TYPES:  # OpenAI's (python: refused there, saying why)
        criterion = checked_with_judges(organization, item, param, pass_threshold=True)
        return {**criterion, "name": criterion.get("name") or kind}
    if not isinstance(kind, str) or kind not in GRADERS:
        raise ApiError(
            f"{param}.type: unknown grader {str(kind)[:40]!r}; use one of {', '.join(KNOWN)}",
            param=f"{param}.type", code="unknown_grader",
        )
    assert isinstance(item, dict)
    return _kept(_parsed(index, _MODELS[kind], item))


def checked_with_judges(organization: Organization, raw: object, param: str, pass_threshold: bool = False) -> dict:
    """One of OpenAI's graders as kept (``core.graders.spec``), or the 400 naming its field under
    ``param``; a judge the organization may not use is its 404."""
    grader = checked_grader(raw, param, pass_threshold=pass_threshold)
    for where, model in judge_models(grader):  # where: "model", "graders.<name>.model"
        usable_target(organization, Target(model), f"{param}.{where}".removesuffix(".model"))
    return grader


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
            )
        seen.add(criterion["name"])
