"""The evaluation gate: after training, before the new revision is published, the job's held-out
examples are answered through the serving engine by the reference (the base model, or the parent's
current revision for a continued fine-tune) and by the new revision (written to the dynamic LoRA
path, so the pool serves it pinned, but not yet what the name answers with). Both are scored with
the job's graders (``core.evaluation``, the tenant's patterns and schemas in ``core.grading``'s
sandbox); the revision is published only if it scores at least the reference's score plus the
threshold. An answer whose grading took too long fails that grader, and the scores say how many.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import httpx

from base.serving_client import pool_headers, pool_url
from core.datasets import Example
from core.evaluation import Case, Grader, cases_of, score
from core.grading import GradingSandbox, describe

MAX_CASES = 50  # the examples scored, at most: two answers each, on the engine
MAX_ANSWER_TOKENS = 64
CONCURRENT_REQUESTS = 8  # batched together by the engine
REQUEST_TIMEOUT_S = 120.0


class EvaluationUnavailable(Exception):
    """The pool did not answer the evaluation's requests."""


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


def evaluate(evaluation: dict, examples: list[Example], reference: str, adapter: str) -> Scores:
    graders = [Grader(**grader) for grader in evaluation["graders"]]
    cases = cases_of(examples, MAX_CASES)
    with httpx.Client(headers=pool_headers(), timeout=REQUEST_TIMEOUT_S) as client:
        reference_answers = _answers(client, reference, cases)
        adapter_answers = _answers(client, adapter, cases)
    with GradingSandbox() as sandbox:
        reference_score = score(graders, reference_answers, cases, sandbox.passes)
        adapter_score = score(graders, adapter_answers, cases, sandbox.passes)
    timeouts = {describe(grader): count for grader, count in sandbox.timeouts.items()}
    return Scores(reference, reference_score, adapter, adapter_score, evaluation["threshold"], len(cases), timeouts)


def _answers(client: httpx.Client, model: str, cases: list[Case]) -> list[str]:
    def answer(case: Case) -> str:
        body = {"model": model, "messages": case.prompt, "max_tokens": MAX_ANSWER_TOKENS, "temperature": 0}
        try:
            response = client.post(pool_url("/v1/chat/completions"), json=body)
            response.raise_for_status()
            return response.json()["choices"][0]["message"]["content"] or ""
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            raise EvaluationUnavailable(f"{model}: {exc}") from None

    with ThreadPoolExecutor(CONCURRENT_REQUESTS) as workers:
        return list(workers.map(answer, cases))
