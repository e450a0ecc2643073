"""One grader engine for everything on the platform that scores an answer: eval runs, the publish
gate, early stopping, ``graders.run``, reinforcement fine-tuning. ``grade`` applies a grader kept by
``core.graders.spec`` to one item and one sample.

It never raises for a tenant's data: a formula that divides by zero, a judge that is unavailable,
a field the item lacks give a Result with score 0.0, ``passed`` False (None where no threshold
applies) and ``details["error"]`` saying what happened; one bad row scores 0 instead of stopping a
run of thousands. The judge is a function the caller passes (the platform's, through the serving
pool), so this module stays pure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from core import strict_json
from core.api_errors import logged_instead
from core.graders.formula import FormulaError, calculate
from core.graders.judging import JudgeRequest, judge_request, read_verdict
from core.graders.result import Result, error_result
from core.graders.similarity import similarity
from core.graders.spec import sub_graders
from core.graders.template import substitute

__all__ = ["Judge", "JudgeUnavailable", "Result", "grade", "sample_of"]

log = logging.getLogger(__name__)

Judge = Callable[[JudgeRequest], str]  # the judge model's reply text; raises JudgeUnavailable


class JudgeUnavailable(Exception):
    """The judge model could not answer (no replica, a timeout, the model is unknown): the message
    says so in words for the tenant."""


def sample_of(output_text: str, tool_calls: list[dict] | None = None) -> dict:
    """OpenAI's ``sample`` namespace for an answer: ``output_text``; ``output_json``, the text parsed
    when it is JSON (None otherwise); ``output_tools``, the answer's tool calls in Chat Completions'
    shape; ``choices``, the one choice as Chat Completions gives it."""
    try:
        output_json = strict_json.loads(output_text)
    except strict_json.JsonRefused:
        output_json = None
    tools = list(tool_calls or [])
    message = {"role": "assistant", "content": output_text, **({"tool_calls": tools} if tools else {})}
    return {
        "output_text": output_text,
        "output_json": output_json,
        "output_tools": tools,
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if tools else "stop"}],
    }


def grade(
    grader: dict, item: dict, sample: dict, judge: Judge | None = None, pass_threshold: float | None = None
) -> Result:
    """``grader``'s Result for ``sample`` on ``item``. ``pass_threshold`` overrides the grader's own
    (the evals form keeps one in the grader)."""
    threshold = pass_threshold if pass_threshold is not None else grader.get("pass_threshold")
    try:
        result = _graded(grader, item, sample, judge)
    except Exception as exc:  # a bug of ours, not the tenant's: logged, and this sample scores 0
        log.exception("grading with a %s grader failed", grader.get("type"))
        result = error_result(f"the grader failed unexpectedly {logged_instead('grading failed', repr(exc))}")
    return _judged(result, grader, threshold)


def _graded(grader: dict, item: dict, sample: dict, judge: Judge | None) -> Result:
    kind = grader["type"]
    if kind == "string_check":
        return _string_check(grader, item, sample)
    if kind == "text_similarity":
        output, reference = substitute(grader["input"], item, sample), substitute(grader["reference"], item, sample)
        return Result(similarity(grader["evaluation_metric"], output, reference), None)
    if kind in ("score_model", "label_model"):
        return _model_graded(grader, item, sample, judge)
    if kind == "multi":
        return _multi(grader, item, sample, judge)
    return error_result(f"{kind} graders are not offered here")  # spec refused them when the grader was given


def _string_check(grader: dict, item: dict, sample: dict) -> Result:
    given, reference = substitute(grader["input"], item, sample), substitute(grader["reference"], item, sample)
    # OpenAI's operations: eq and ne compare whole strings; like is "contains" (case counts), ilike
    # "contains" with case ignored.
    matched = {
        "eq": lambda: given == reference,
        "ne": lambda: given != reference,
        "like": lambda: reference in given,
        "ilike": lambda: reference.casefold() in given.casefold(),
    }[grader["operation"]]()
    return Result(1.0 if matched else 0.0, matched)


def _model_graded(grader: dict, item: dict, sample: dict, judge: Judge | None) -> Result:
    if judge is None:
        return error_result(f"no judge was given to run the {grader['type']} grader's model {grader['model']!r}")
    try:
        reply = judge(judge_request(grader, item, sample))
    except JudgeUnavailable as exc:
        return error_result(f"the judge model {grader['model']!r} is unavailable: {exc}")
    return read_verdict(grader, reply)


def _multi(grader: dict, item: dict, sample: dict, judge: Judge | None) -> Result:
    results = {name: grade(sub, item, sample, judge) for name, sub in sub_graders(grader).items()}
    details: dict = {
        "sub_scores": {name: result.score for name, result in results.items()},
        "sub_details": {name: result.details for name, result in results.items() if result.details},
    }
    failed = [f"{name}: {result.error}" for name, result in results.items() if result.error]
    if failed:
        # Not the formula over a 0 that stands for "could not grade": that would look like a real score.
        return error_result(f"grader {'; grader '.join(failed)}", **details)
    try:
        score = calculate(grader["calculate_output"], details["sub_scores"])
    except FormulaError as exc:
        return error_result(f"calculate_output: {exc}", **details)
    return Result(score, None, details)


def _judged(result: Result, grader: dict, threshold: float | None) -> Result:
    """``passed`` as the grader's kind and threshold say: label_model by its passing labels,
    string_check by a full match, the rest by the threshold; None with no threshold."""
    kind = grader.get("type")
    if threshold is not None:
        passed: bool | None = False if result.error else result.score >= threshold
        if kind == "label_model":
            passed = bool(result.passed)
    elif kind in ("label_model", "string_check"):
        passed = False if result.error else bool(result.passed)
    else:
        passed = None
    return Result(result.score, passed, result.details)
