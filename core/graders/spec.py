"""A tenant's grader, as the JSON body gives it, checked and kept: OpenAI's grader objects
(``openai.types.graders``) with their field names, parsed strictly (a wrong type, an unknown field,
NaN or an infinity, a string past its cap is a 400 naming the field), with what this platform does
not offer refused by name:

- ``python`` graders run the tenant's code, which would need a sandbox this platform does not run;
- text_similarity's ``cosine`` needs an embedding model, and none is served here;
- images and audio in a model grader's input: the judge models served here read text.

``pass_threshold=True`` is the evals form (OpenAI's ``TestingCriterion*``): text_similarity must
have a ``pass_threshold``, score_model and multi may have one, the others take none. The fine-tuning
form (``graders.run``, ``graders.validate``, a reinforcement job's grader) takes none at all.

A multi grader's ``graders`` is, in the installed client's type, one grader; OpenAI's graders guide
and API take an object of named graders (``{"name": {...}, "email": {...}}``). Both are accepted,
and kept as given; ``sub_graders`` reads either. Its formula names the graders by those names (the
one grader's ``name`` in the first form).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, ValidationError, ValidationInfo, field_validator

from core.api_errors import ApiError
from core.graders.formula import formula_problem
from core.graders.template import template_problem

GRADER_TYPES = ("string_check", "text_similarity", "score_model", "label_model", "multi", "python")
OFFERED = ("string_check", "text_similarity", "score_model", "label_model", "multi")
MAX_TEMPLATE_CHARS = 10_000
MAX_NAME_CHARS = 64
MAX_LABEL_CHARS, MAX_LABELS = 100, 32
MAX_MESSAGES = 16  # a model grader's input
MAX_CONTENT_PARTS = 16  # one message's content, when a list
MAX_SUB_GRADERS = 10  # a multi grader's
MAX_MODEL_CHARS = 300
# A judge answers with a label or a score, and perhaps a sentence of reasoning: more is waste.
MAX_JUDGE_TOKENS = 2_048
MAX_SCORE_BOUND = 1e6  # a score_model's range and a multi's pass_threshold lie within plus or minus this

_NAME = Field(min_length=1, max_length=MAX_NAME_CHARS)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _checked_template(text: str) -> str:
    problem = template_problem(text)
    if problem is not None:
        raise ValueError(problem)
    return text


Template = Annotated[str, Field(max_length=MAX_TEMPLATE_CHARS)]
Label = Annotated[str, Field(min_length=1, max_length=MAX_LABEL_CHARS)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Grader(_Strict):
    name: str = _NAME


class StringCheck(_Grader):
    type: Literal["string_check"]
    operation: Literal["eq", "ne", "like", "ilike"]
    input: Template
    reference: Template

    _templates = field_validator("input", "reference")(_checked_template)


class TextSimilarity(_Grader):
    type: Literal["text_similarity"]
    evaluation_metric: Literal[
        "cosine",
        "fuzzy_match",
        "bleu",
        "gleu",
        "meteor",
        "rouge_1",
        "rouge_2",
        "rouge_3",
        "rouge_4",
        "rouge_5",
        "rouge_l",
    ]
    input: Template
    reference: Template

    _templates = field_validator("input", "reference")(_checked_template)


class _TextPart(_Strict):
    type: Literal["input_text", "output_text"]
    text: Template

    _template = field_validator("text")(_checked_template)


def _checked_content(value: object) -> object:
    """A message's content, as OpenAI's types take it: a string, one text part, or a list of them
    (each ``{"type": "input_text" | "output_text", "text"}``); images and audio refused by name."""
    if isinstance(value, str):
        if len(value) > MAX_TEMPLATE_CHARS:
            raise ValueError(f"at most {MAX_TEMPLATE_CHARS:,} characters are allowed")
        return _checked_template(value)
    if not isinstance(value, (dict, list)):
        raise ValueError("content is a string, a text part or a list of text parts")
    parts = value if isinstance(value, list) else [value]
    if not 1 <= len(parts) <= MAX_CONTENT_PARTS:
        raise ValueError(f"a list of 1 to {MAX_CONTENT_PARTS} content parts is allowed")
    for index, part in enumerate(parts):
        where = f"part {index}: " if isinstance(value, list) else ""
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_audio"):
            raise ValueError(
                f"{where}{kind} content is not offered here: the judge models served here read text; give the "
                "content as text (input_text or output_text)"
            )
        try:
            _TextPart.model_validate(part)
        except ValidationError as exc:
            problem = exc.errors()[0]
            field = ".".join(str(step) for step in problem.get("loc", ())) or "the part"
            raise ValueError(f"{where}{field}: {str(problem['msg']).removeprefix('Value error, ')}") from None
    return value


class Message(_Strict):
    """One message of a model grader's input: OpenAI's EasyInputMessage / EvalItem, text only."""

    role: Literal["user", "assistant", "system", "developer"]
    content: Any
    type: Literal["message"] | None = None

    _content = field_validator("content")(_checked_content)


class SamplingParams(_Strict):
    max_completions_tokens: int | None = Field(None, ge=1, le=MAX_JUDGE_TOKENS)  # OpenAI's spelling
    # Taken as OpenAI's type has it; the judges served here do not reason, so it changes nothing.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)


class _ModelGrader(_Grader):
    model: str = Field(min_length=1, max_length=MAX_MODEL_CHARS)
    input: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)


# A score's bounds: any scale a rubric uses, far from where floats lose their digits (a range of
# 1e308 would make every bar and mean meaningless, and sums of such scores overflow).
Bound = Annotated[float, Field(ge=-MAX_SCORE_BOUND, le=MAX_SCORE_BOUND, allow_inf_nan=False)]


class ScoreModel(_ModelGrader):
    type: Literal["score_model"]
    range: list[Bound] = Field([0.0, 1.0], min_length=2, max_length=2)
    sampling_params: SamplingParams | None = None

    @field_validator("range")
    @classmethod
    def _increasing(cls, value: list[float]) -> list[float]:
        if not value[0] < value[1]:
            raise ValueError("the range is [min, max] with min < max")
        return value


class LabelModel(_ModelGrader):
    type: Literal["label_model"]
    labels: list[Label] = Field(min_length=1, max_length=MAX_LABELS)
    passing_labels: list[Label] = Field(min_length=1, max_length=MAX_LABELS)

    @field_validator("labels")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("each label may appear once")
        return value

    @field_validator("passing_labels")
    @classmethod
    def _among_labels(cls, value: list[str], info: ValidationInfo) -> list[str]:
        labels = info.data.get("labels")
        unknown = [label for label in value if labels is not None and label not in labels]
        if unknown:
            raise ValueError(f"passing_labels must be among labels; {unknown[0]!r} is not")
        return value


class Multi(_Grader):
    type: Literal["multi"]
    calculate_output: str = Field(min_length=1, max_length=1_000)
    graders: dict[str, Any]  # checked one by one by ``_checked``, for their own types' messages


_MODELS: dict[str, type[_Grader]] = {
    "string_check": StringCheck,
    "text_similarity": TextSimilarity,
    "score_model": ScoreModel,
    "label_model": LabelModel,
    "multi": Multi,
}
# The evals form: OpenAI's TestingCriterion* types add a pass_threshold to these.


class TextSimilarityCriterion(TextSimilarity):
    pass_threshold: float = Field(ge=0, le=1, allow_inf_nan=False)  # a metric lies in [0, 1]


class ScoreModelCriterion(ScoreModel):
    pass_threshold: FiniteFloat | None = None

    @field_validator("pass_threshold")
    @classmethod
    def _within_range(cls, value: float | None, info: ValidationInfo) -> float | None:
        low, high = info.data.get("range") or (None, None)
        if value is not None and low is not None and high is not None and not low <= value <= high:
            raise ValueError(f"pass_threshold must lie within the range [{low:g}, {high:g}]")
        return value


class MultiCriterion(Multi):
    pass_threshold: Bound | None = None


_CRITERIA: dict[str, type[_Grader]] = {
    **_MODELS,
    "text_similarity": TextSimilarityCriterion,
    "score_model": ScoreModelCriterion,
    "multi": MultiCriterion,
}


def checked_grader(raw: object, param: str, *, pass_threshold: bool = False) -> dict:
    """The grader as kept (OpenAI's field names, defaults filled: score_model's ``range`` [0, 1]),
    or an ``ApiError`` (400, ``param`` the field at fault below ``param``) saying what to fix."""
    return _checked(raw, param, models=_CRITERIA if pass_threshold else _MODELS, nested=False)


def sub_graders(grader: dict) -> dict[str, dict]:
    """A kept multi grader's graders by the names its formula uses, whichever form it was given in."""
    graders = grader["graders"]
    return {graders["name"]: graders} if _is_one_grader(graders) else graders


def judge_models(grader: dict) -> list[tuple[str, str]]:
    """(the field's path within ``grader``, the model) of every model grader in a kept grader,
    a multi grader's included, so the platform can check the caller may use each model."""
    if grader["type"] in ("score_model", "label_model"):
        return [("model", grader["model"])]
    if grader["type"] != "multi":
        return []
    one = _is_one_grader(grader["graders"])
    found = []
    for key, sub in sub_graders(grader).items():
        found += [
            (f"graders.{suffix}" if one else f"graders.{key}.{suffix}", model) for suffix, model in judge_models(sub)
        ]
    return found


def _is_one_grader(graders: dict) -> bool:
    # A grader has a string "type"; an object of named graders may name one "type", but its value is an object.
    return isinstance(graders.get("type"), str)


def _checked(raw: object, param: str, *, models: dict[str, type[_Grader]], nested: bool) -> dict:
    if not isinstance(raw, dict):
        raise _invalid(param, "a grader must be a JSON object with a type")
    kind = raw.get("type")
    if kind == "python":
        raise ApiError(
            f"{param}.type: python graders are not offered here: they run the tenant's code, which would need a "
            "sandbox this platform does not run. Use string_check, text_similarity, score_model, label_model or "
            "multi (which combines them).",
            param=f"{param}.type", code="grader_not_offered",
        )
    if nested and kind == "multi":
        raise _invalid(f"{param}.type", "a multi grader's graders may not be multi graders themselves")
    if not isinstance(kind, str) or kind not in models:
        raise _invalid(f"{param}.type", f"unknown grader type {str(kind)[:40]!r}; use one of {', '.join(OFFERED)}")
    if kind == "text_similarity" and raw.get("evaluation_metric") == "cosine":
        raise ApiError(
            f"{param}.evaluation_metric: cosine needs an embedding model, and none is served here; use fuzzy_match, "
            "bleu, gleu, meteor or rouge_1 to rouge_5 or rouge_l.",
            param=f"{param}.evaluation_metric", code="grader_not_offered",
        )
    try:
        parsed = models[kind].model_validate(raw)
    except ValidationError as exc:
        raise _from_validation(exc, param, kind, models[kind]) from None
    kept = parsed.model_dump(exclude_none=True)
    if isinstance(parsed, Multi):
        kept["graders"] = _checked_sub_graders(raw["graders"], f"{param}.graders")
        names = set(sub_graders(kept))
        problem = formula_problem(parsed.calculate_output, names)
        if problem is not None:
            raise _invalid(f"{param}.calculate_output", problem)
    return kept


def _checked_sub_graders(graders: dict, param: str) -> dict:
    if _is_one_grader(graders):
        return _checked(graders, param, models=_MODELS, nested=True)
    if not 1 <= len(graders) <= MAX_SUB_GRADERS:
        raise _invalid(param, f"a multi grader combines 1 to {MAX_SUB_GRADERS} graders")
    kept = {}
    for key, sub in graders.items():
        if not _IDENTIFIER.fullmatch(key) or len(key) > MAX_NAME_CHARS:
            raise _invalid(
                f"{param}.{key[:MAX_NAME_CHARS]}",
                "a grader's key is the name calculate_output uses: letters, digits and _, not starting with a digit",
            )
        kept[key] = _checked(sub, f"{param}.{key}", models=_MODELS, nested=True)
    return kept


def _from_validation(exc: ValidationError, param: str, kind: str, model: type[_Grader]) -> ApiError:
    """The first problem pydantic found, as a 400 naming its field under ``param``."""
    problem = exc.errors()[0]
    location = [str(part) for part in problem.get("loc", ())]
    message = str(problem["msg"]).removeprefix("Value error, ")
    if problem["type"] == "extra_forbidden":
        message = "unknown field"
        if len(location) == 1:
            message += f"; a {kind} grader here takes {', '.join(model.model_fields)}"
    elif problem["type"] == "missing":
        message = "this field is required"
    return _invalid(".".join([param, *location]), message)


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(f"{param}: {message}", param=param, code="invalid_grader")
