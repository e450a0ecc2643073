"""Answering items and grading the answers: what an eval run and the publish gate both do, with one
grader engine for every criterion.

The answers go through ``answering.batch`` (the model's own backend, the organization's usage);
OpenAI's graders are ``core.graders``' (a model grader's judge asks its model through the same
``Answerer``, counted in the organization's usage as background work), the platform's own are
``core.evaluation``'s, the tenant's patterns and schemas in ``core.grading``'s sandbox. An item
that was not answered is graded by nothing: it has no results.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TypeVar

from answering.batch import Answer, Answerer, Sampling, Target
from core.eval_items import EvalItem
from core.eval_prompts import prompt_of
from core.evaluation import GRADERS, Grader
from core.graders.engine import JudgeUnavailable, Result, grade, sample_of
from core.graders.judging import JudgeRequest
from core.grading import GradingSandbox

BATCH_SIZE = 8  # answers asked for at once (the engine batches them); a cancel is seen between batches
T = TypeVar("T")


@dataclass(frozen=True)
class Scored:
    item: EvalItem
    prompt: list[dict]  # what the model answered ([] for a sample given in advance)
    answer: Answer
    results: list[Result]  # per criterion, in order; empty when there is no answer

    @property
    def answered(self) -> bool:
        return self.answer.text is not None


class Grading:
    """Every criterion's result for an item and a sample: the platform's graders through the
    sandbox, OpenAI's through ``core.graders.engine.grade`` with this organization's judges."""

    def __init__(self, answerer: Answerer, sandbox: GradingSandbox):
        self.answerer, self.sandbox = answerer, sandbox
        self.judge_tokens: Counter[str] = Counter()  # per judge model, prompt and completion tokens

    def results(self, criteria: list[dict], item: EvalItem, sample: dict) -> list[Result]:
        return [self.result(criterion, item, sample) for criterion in criteria]

    def result(self, criterion: dict, item: EvalItem, sample: dict) -> Result:
        if criterion["type"] in GRADERS:
            grader = Grader.of(criterion)
            expected = item.item.get("expected")
            passed = self.sandbox.passes(grader, sample["output_text"], expected if isinstance(expected, str) else "")
            return Result(float(passed), passed, {})
        return grade(criterion, item.item, sample, self.judge, criterion.get("pass_threshold"))

    def judge(self, request: JudgeRequest) -> str:
        """A model grader's verdict: its judge's answer, asked as any background chat is."""
        sampling = Sampling(**request.sampling, response_format=request.response_format)
        (answer,) = self.answerer.answer(Target(request.model), [request.messages], sampling)
        self.judge_tokens[request.model] += answer.tokens.prompt + answer.tokens.completion
        if answer.text is None:
            raise JudgeUnavailable(f"{request.model}: {answer.error_code}: {answer.error_message}")
        return answer.text


def answered_and_graded(
    grading: Grading, target: Target | None, criteria: list[dict], items: list[EvalItem], input_messages: dict | None,
    sampling: Sampling,
) -> list[Scored]:  # fmt: skip
    """One batch: each item answered by ``target`` from ``input_messages`` (or, without a target, its
    own sample), then graded by every criterion."""
    if target is None:
        answers = [Answer((item.sample or {}).get("output_text", ""), answered_by=str((item.sample or {}).get("model", "")))
                   for item in items]  # fmt: skip
        prompts: list[list[dict]] = [[] for _ in items]
    else:
        assert input_messages is not None
        made = [prompt_of(input_messages, item.item) for item in items]
        prompts = [prompt or [] for prompt, _problem in made]
        asked = [index for index, (prompt, _problem) in enumerate(made) if prompt is not None]
        replies = iter(grading.answerer.answer(target, [prompts[index] for index in asked], sampling) if asked else [])
        answers = [next(replies) if prompt is not None else Answer(None, error_code="invalid_item", error_message=str(problem))
                   for prompt, problem in made]  # fmt: skip
    scored = []
    for item, prompt, answer in zip(items, prompts, answers):
        if answer.text is None:
            scored.append(Scored(item, prompt, answer, []))
            continue
        sample = {**(item.sample or {}), **sample_of(answer.text, answer.tool_calls)} if target else _given(item)
        scored.append(Scored(item, prompt, answer, grading.results(criteria, item, sample)))
    return scored


def _given(item: EvalItem) -> dict:
    """A jsonl item's own sample, with what ``sample_of`` derives (``output_json``) filled in."""
    given = item.sample or {}
    return {**sample_of(str(given.get("output_text", "")), given.get("output_tools")), **given}


def in_batches(items: list[T], size: int = BATCH_SIZE) -> list[list[T]]:
    return [items[start : start + size] for start in range(0, len(items), size)]
