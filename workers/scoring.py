"""Answering items and grading the answers: what an eval run and the publish gate both do, with one
grader engine for every criterion.

The answers go through ``answering.batch`` (the model's own backend, the organization's usage);
OpenAI's graders are ``core.graders``' (a model grader's judge asks its model through the same
``Answerer``, counted in the organization's usage as background work), the platform's own are
``core.evaluation``'s, the tenant's patterns and schemas in ``core.grading``'s sandbox. An item
that was not answered is graded by nothing: it has no results.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import TypeVar

from answering.batch import Answer, Answerer, Sampling, Target
from core.eval_items import EvalItem
from core.eval_prompts import prompt_of
from core.evaluation import GRADERS, Grader
from core.graders.engine import JudgeUnavailable, Result, grade, sample_of
from core.graders.judging import JudgeRequest, judge_request
from core.graders.spec import sub_graders
from core.grading import GradingSandbox

BATCH_SIZE = 8  # answers asked for at once (the engine batches them); a cancel is seen between batches
JUDGED = ("score_model", "label_model")  # OpenAI's graders that ask a model
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
    sandbox, OpenAI's through ``core.graders.engine.grade`` with this organization's judges.

    A batch's judges are asked all at once (``results_of``: the engine batches them) rather than
    one after another as the engine grades; what ``grade`` then asks is read from those replies."""

    def __init__(self, answerer: Answerer, sandbox: GradingSandbox):
        self.answerer, self.sandbox = answerer, sandbox
        self.judge_tokens: Counter[str] = Counter()  # per judge model, prompt and completion tokens
        self._replies: dict[str, Answer] = {}  # asked ahead (``_ask_judges``), by ``_key``

    def results_of(self, criteria: list[dict], graded: list[tuple[EvalItem, dict]]) -> list[list[Result]]:
        """Each (item, sample)'s results, every criterion's, its judges asked for the whole list at once."""
        self._ask_judges([request for item, sample in graded for grader in _judged(criteria)
                          if (request := _request(grader, item, sample)) is not None])
        try:
            return [[self.result(criterion, item, sample) for criterion in criteria] for item, sample in graded]
        finally:
            self._replies.clear()

    def result(self, criterion: dict, item: EvalItem, sample: dict) -> Result:
        if criterion["type"] in GRADERS:
            grader = Grader.of(criterion)
            expected = item.item.get("expected")
            passed = self.sandbox.passes(grader, sample["output_text"], expected if isinstance(expected, str) else "")
            return Result(float(passed), passed, {})
        return grade(criterion, item.item, sample, self.judge, criterion.get("pass_threshold"))

    def judge(self, request: JudgeRequest) -> str:
        """A model grader's verdict: its judge's answer (asked ahead, or now), asked as any background chat is."""
        answer = self._replies.pop(_key(request), None)
        if answer is None:
            (answer,) = self._asked([request])
        if answer.text is None:
            raise JudgeUnavailable(f"{request.model}: {answer.error_code}: {answer.error_message}")
        return answer.text

    def _ask_judges(self, requests: list[JudgeRequest]) -> None:
        """Ask ``requests`` at once, one batch per model and sampling, and keep the replies for ``judge``."""
        alike: dict[str, list[JudgeRequest]] = {}
        for request in requests:
            alike.setdefault(_key(request, messages=False), []).append(request)
        for group in alike.values():
            for request, answer in zip(group, self._asked(group)):
                self._replies[_key(request)] = answer

    def _asked(self, requests: list[JudgeRequest]) -> list[Answer]:
        """Judge requests of one model and sampling, answered together."""
        first = requests[0]
        sampling = Sampling(**first.sampling, response_format=first.response_format)
        answers = self.answerer.answer(Target(first.model), [request.messages for request in requests], sampling)
        for answer in answers:
            self.judge_tokens[first.model] += answer.tokens.prompt + answer.tokens.completion
        return answers


def _judged(criteria: list[dict]) -> list[dict]:
    """The model graders among ``criteria``, a multi grader's included."""
    found = []
    for grader in criteria:
        if grader["type"] in JUDGED:
            found.append(grader)
        elif grader["type"] == "multi":
            found.extend(_judged(list(sub_graders(grader).values())))
    return found


def _request(grader: dict, item: EvalItem, sample: dict) -> JudgeRequest | None:
    """The judge request ``grade`` will make; None when making it fails (``grade`` then says why, as an error result)."""
    try:
        return judge_request(grader, item.item, sample)
    except Exception:  # noqa: BLE001  # the tenant's data: grading reports it, never the batch
        return None


def _key(request: JudgeRequest, messages: bool = True) -> str:
    """What makes two judge requests the same one (with ``messages``), or answerable together (without)."""
    fields = {"model": request.model, "sampling": request.sampling, "format": request.response_format}
    return json.dumps(fields | ({"messages": request.messages} if messages else {}), sort_keys=True)


def answered_and_graded(
    grading: Grading, target: Target | None, criteria: list[dict], items: list[EvalItem], input_messages: dict | None,
    sampling: Sampling,
) -> list[Scored]:
    """One batch: each item answered by ``target`` from ``input_messages`` (or, without a target, its
    own sample), then graded by every criterion."""
    if target is None:
        answers = [Answer((item.sample or {}).get("output_text", ""), answered_by=str((item.sample or {}).get("model", "")))
                   for item in items]
        prompts: list[list[dict]] = [[] for _ in items]
    else:
        assert input_messages is not None
        made = [prompt_of(input_messages, item.item) for item in items]
        prompts = [prompt or [] for prompt, _problem in made]
        asked = [index for index, (prompt, _problem) in enumerate(made) if prompt is not None]
        replies = iter(grading.answerer.answer(target, [prompts[index] for index in asked], sampling) if asked else [])
        answers = [next(replies) if prompt is not None else Answer(None, error_code="invalid_item", error_message=str(problem))
                   for prompt, problem in made]
    answered = [(item, answer) for item, answer in zip(items, answers) if answer.text is not None]
    samples = [{**(item.sample or {}), **sample_of(answer.text or "", answer.tool_calls)} if target else _given(item)
               for item, answer in answered]
    results = iter(grading.results_of(criteria, [(item, sample) for (item, _answer), sample in zip(answered, samples)]))
    return [Scored(item, prompt, answer, next(results) if answer.text is not None else [])
            for item, prompt, answer in zip(items, prompts, answers)]


def _given(item: EvalItem) -> dict:
    """A jsonl item's own sample, with what ``sample_of`` derives (``output_json``) filled in."""
    given = item.sample or {}
    return {**sample_of(str(given.get("output_text", "")), given.get("output_tools")), **given}


def in_batches(items: list[T], size: int = BATCH_SIZE) -> list[list[T]]:
    return [items[start : start + size] for start in range(0, len(items), size)]
