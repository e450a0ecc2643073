"""Runs that compare one fine-tuned model with what it came from, as the dashboard's models page
starts them: with its base model, or each of its revisions (``<name>@r<N>``) against the others.
Both go through ``evals.creation.start_runs``, so they are refused as the API's runs are (and then
nothing is started)."""

from __future__ import annotations

from django.contrib.auth.models import User

from accounts.models import Organization
from core.api_errors import ApiError
from core.model_names import with_revision
from evals.creation import start_runs
from evals.models import Eval, EvalRun
from base.api_views import parsed
from evals.requests import MAX_MODELS_PER_CALL, RunCreate
from finetuning.models import FineTunedModel

# One call starts a run for ``data_source.model`` and one for each of ``models``.
MOST_REVISIONS_COMPARED = MAX_MODELS_PER_CALL + 1


def compare_with_base(
    organization: Organization, user: User | None, evaluation: Eval, model: FineTunedModel
) -> list[EvalRun]:
    """Two runs: the base model first (the page marks the fine-tune's answers against it), then the model."""
    return start_runs(organization, user, evaluation, _runs_of([model.base_model, model.name]))


def compare_revisions(
    organization: Organization, user: User | None, evaluation: Eval, model: FineTunedModel
) -> list[EvalRun]:
    """A run per revision, pinned (``@r<N>``), oldest first; the newest ``MOST_REVISIONS_COMPARED`` of a long history."""
    numbers = sorted(model.revisions.values_list("number", flat=True))[-MOST_REVISIONS_COMPARED:]
    if len(numbers) < 2:
        raise ApiError(
            f"{model.name} has one revision: there is nothing to compare it with yet. Compare it with its base model, "
            "or fine-tune it again to publish a second revision.",
            param="model", code="nothing_to_compare",
        )
    return start_runs(
        organization, user, evaluation, _runs_of([with_revision(model.name, number) for number in numbers])
    )


def _runs_of(models: list[str]) -> RunCreate:
    first, *others = models
    return parsed(RunCreate, {"data_source": {"type": "completions", "model": first}, "models": others or None})
