"""The evaluation gate: after training, before the new revision is published, the job's held-out
examples are answered by the reference (the base model, or the parent's current revision for a
continued fine-tune) and by the new revision (written to the dynamic LoRA path, so its backend
serves it pinned, but not yet what the name answers with). Both are scored with the job's graders;
the revision is published only if it scores at least the reference's score plus the threshold.
An answer whose grading took too long fails that grader, and the scores say how many.

Answering and grading are an eval run's (``workers.scoring``): the answers go to the model's own
backend (the embedded pool or Ray Serve) and count in the job's organization's usage; the tenant's
patterns and schemas are graded in ``core.grading``'s sandbox.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from answering.batch import Answerer, Sampling, Target
from core.datasets import Example
from core.eval_items import EvalItem, chat_items
from core.eval_prompts import DEFAULT_INPUT
from core.evaluation import mean_score
from core.grading import GradingSandbox, describe
from workers.scoring import Grading, answered_and_graded, in_batches

MAX_CASES = 50  # the examples scored, at most: two answers each, on the engine
MAX_ANSWER_TOKENS = 64
GREEDY = Sampling(max_completion_tokens=MAX_ANSWER_TOKENS, temperature=0.0)


class EvaluationUnavailable(Exception):
    """The serving backend did not answer the evaluation's requests."""


@dataclass(frozen=True)
class Scores:
    reference: str
    reference_score: float
    adapter: str
    adapter_score: float
    threshold: float
    examples: int
    timeouts: dict[str, int]  # per grader (``core.grading.describe``): answers failed for taking too long

    @property
    def passed(self) -> bool:
        return self.adapter_score >= self.reference_score + self.threshold - 1e-9

    def as_dict(self) -> dict:
        return asdict(self) | {"passed": self.passed}


def evaluate(organization_id: int, evaluation: dict, examples: list[Example], reference: str, adapter: str) -> Scores:
    criteria = evaluation["graders"]
    items = chat_items(examples, MAX_CASES)
    with Answerer(organization_id) as answerer, GradingSandbox() as sandbox:
        grading = Grading(answerer, sandbox)
        reference_score = mean_score(_scores(grading, reference, criteria, items))
        adapter_score = mean_score(_scores(grading, adapter, criteria, items))
    timeouts = {describe(grader): count for grader, count in sandbox.timeouts.items()}
    return Scores(reference, reference_score, adapter, adapter_score, evaluation["threshold"], len(items), timeouts)


def checkpoint_score(organization_id: int, evaluation: dict, examples: list[Example], checkpoint: str) -> float:
    """A checkpoint's score by the job's graders on its held-out examples (early stopping by
    ``eval_score``: ``workers.training.early_stopping``); EvaluationUnavailable as for the gate."""
    items = chat_items(examples, MAX_CASES)
    with Answerer(organization_id) as answerer, GradingSandbox() as sandbox:
        return mean_score(_scores(Grading(answerer, sandbox), checkpoint, evaluation["graders"], items))


def _scores(grading: Grading, model: str, criteria: list[dict], items: list[EvalItem]) -> list[list[float]]:
    """Each item's scores (one per criterion) for ``model``'s answer; EvaluationUnavailable when one
    did not come back (a gate must not pass or fail on answers it never saw)."""
    found = []
    for batch in in_batches(items):
        for scored in answered_and_graded(grading, Target(model), criteria, batch, DEFAULT_INPUT, GREEDY):
            if not scored.answered:
                raise EvaluationUnavailable(f"{model}: {scored.answer.error_code}: {scored.answer.error_message}")
            found.append([result.score for result in scored.results])
    return found
