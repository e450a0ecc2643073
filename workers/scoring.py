"""Answering examples and grading the answers: what an eval run and the publish gate both do.

The answers go through ``answering.batch`` (the model's own backend, the organization's usage);
the graders are ``core.evaluation``'s, the tenant's patterns and schemas in ``core.grading``'s
sandbox. An answer that did not come back is graded by nothing: it has no verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass

from answering.batch import Answer, Answerer, Sampling, Target
from core.evaluation import Case, Grader, verdicts
from core.grading import GradingSandbox

BATCH_SIZE = 8  # answers asked for at once (the engine batches them); a cancel is seen between batches


@dataclass(frozen=True)
class Scored:
    case: Case
    answer: Answer
    passed: list[bool]  # per grader, in order; empty when there is no answer

    @property
    def answered(self) -> bool:
        return self.answer.text is not None


def answered_and_graded(
    answerer: Answerer, sandbox: GradingSandbox, target: Target, graders: list[Grader], cases: list[Case], sampling: Sampling
) -> list[Scored]:
    """One batch: ``cases``' answers by ``target``, each graded by every grader."""
    answers = answerer.answer(target, [case.prompt for case in cases], sampling)
    return [
        Scored(case, answer, verdicts(graders, answer.text, case, sandbox.passes) if answer.text is not None else [])
        for case, answer in zip(cases, answers)
    ]


def in_batches(cases: list[Case], size: int = BATCH_SIZE) -> list[list[Case]]:
    return [cases[start : start + size] for start in range(0, len(cases), size)]
