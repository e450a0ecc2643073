"""Scoring an eval run on a worker: claim it, check its model is still the organization's to use,
answer its items a batch at a time (a jsonl run's items bring their answers), grade each answer with
every criterion (``workers.scoring``), and keep each batch's output items with the run's progress;
stop when the run is canceled (or deleted) between batches.

Safe to run twice for one run (a redelivered task): only the worker whose conditional update moves
it from "queued" to "in_progress" scores it (``evals.run_status``). An example the backend did not
answer is kept as an "error" item, with the backend's reason, and the run goes on.
"""

from __future__ import annotations

import logging

from celery.exceptions import SoftTimeLimitExceeded

from answering.access import usable_target
from answering.batch import Answerer, Sampling, Target
from core.api_errors import ApiError
from core.graders.spec import judge_models
from core.grading import GradingSandbox
from evals import run_status, sources
from evals.models import EvalRun, OutputItem
from workers.db_retry import retrying
from workers.scoring import Grading, Scored, answered_and_graded, in_batches

log = logging.getLogger(__name__)


def run_eval(run_id: str, worker: str) -> str:
    """Score the run; returns what happened, for the worker's log."""
    run = retrying(run_status.claim, run_id, worker)
    if run is None:
        return f"nothing claimed for {run_id} (it runs elsewhere, has finished, or was deleted)"
    try:
        return _score(run)
    except ApiError as exc:  # its model or file went away since it was created
        retrying(run_status.fail, run_id, exc.code or "run_failed", exc.message)
    except SoftTimeLimitExceeded:
        retrying(run_status.fail, run_id, "time_limit_exceeded", "The run did not finish in time; its scored items are kept.")
    except Exception:
        log.exception("eval run %s failed", run_id)  # a bug or a broken environment
        message = "The run failed on the platform's side; start it again, and if it fails again, tell the platform's operators."
        retrying(run_status.fail, run_id, "run_failed", message)
    return "failed"


def _score(run: EvalRun) -> str:
    target = None
    if run.model:  # a jsonl run has none: its items bring their answers
        target = Target(run.model, tuple((share["model"], share["scale"]) for share in run.adapters or ()))
        usable_target(run.organization, target)  # the caller's access, as when the run was created
    criteria = run.eval.testing_criteria
    for criterion in criteria:  # each judge too, as when the eval was created
        for _where, judge in judge_models(criterion):
            usable_target(run.organization, Target(judge))
    items = retrying(sources.run_items, run)
    retrying(run_status.set_total, run.pk, len(items))
    sampling = Sampling(**run.sampling)
    input_messages = sources.input_messages(run)
    totals, index = run_status.Totals(), 0
    with Answerer(run.organization_id) as answerer, GradingSandbox() as sandbox:
        grading = Grading(answerer, sandbox)
        for batch in in_batches(items):
            kept = []
            for scored in answered_and_graded(grading, target, criteria, batch, input_messages, sampling):
                kept.append(_item(run, index, scored, criteria))
                totals.add(kept[-1])
                index += 1
            if not retrying(run_status.record, run.pk, kept, totals):
                return "canceled"
    retrying(run_status.complete, run.pk, len(items))
    return "completed"


def _item(run: EvalRun, index: int, scored: Scored, criteria: list[dict]) -> OutputItem:
    answer = scored.answer
    results = [
        {"name": criterion["name"], "type": criterion["type"], "score": result.score, "passed": result.passed is not False,
         **({"sample": result.details} if result.details else {})}
        for criterion, result in zip(criteria, scored.results)
    ]
    status = "error" if not scored.answered else ("pass" if all(r["passed"] for r in results) else "fail")
    tokens = answer.tokens
    expected = scored.item.item.get("expected")
    return OutputItem(
        run=run, index=index, item=scored.item.item, prompt=scored.prompt,
        expected=expected if isinstance(expected, str) else "", answer=answer.text, answered_by=answer.answered_by,
        finish_reason=answer.finish_reason, error_code=answer.error_code, error_message=answer.error_message,
        results=results, status=status,
        usage={"prompt_tokens": tokens.prompt, "completion_tokens": tokens.completion, "cached_tokens": tokens.cached}
        if scored.answered and run.model else {},
    )
