"""The dashboard's evaluation pages: the organization's evals, an eval's runs and answers side by
side, canceling a run, and the models page's buttons that start runs comparing a model. Each view
parses, calls one function of the evals app (the one the API calls), and renders or redirects."""

from __future__ import annotations

from collections.abc import Callable

from django.contrib import messages
from django.contrib.auth.models import User
from django.core.paginator import Paginator
from django.db.models import Count
from django.http import HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from accounts.models import Organization
from core.api_errors import ApiError
from dashboard.forms import CompareForm
from dashboard.organizations import OrganizationRequest, with_organization
from evals import model_comparisons, run_status, side_by_side
from evals.models import Eval, EvalRun
from finetuning.models import FineTunedModel

EVALS_PER_PAGE = 50
EXAMPLES_PER_PAGE = 20  # rows of answers side by side: each row holds up to MOST_RUNS_SIDE_BY_SIDE answers
LIVE_REFRESH_SECONDS = 5  # while a run is queued or in progress, the page looks again this often

StartComparison = Callable[[Organization, User | None, Eval, FineTunedModel], list[EvalRun]]


def eval_choices(organization: Organization) -> list[tuple[str, str]]:
    """(id, name) of the organization's evals, newest first: the models page's select offers these."""
    return [(pk, name) for pk, name in Eval.objects.for_org(organization).values_list("pk", "name")]


@with_organization
def eval_list(request: OrganizationRequest) -> HttpResponse:
    evals = Eval.objects.for_org(request.organization).annotate(run_count=Count("runs")).order_by("-created_at", "-id")
    page = Paginator(evals, EVALS_PER_PAGE).get_page(request.GET.get("page"))
    return render(request, "dashboard/evals.html", {"page": page})


@with_organization
def eval_detail(request: OrganizationRequest, eval_id: str) -> HttpResponse:
    evaluation = get_object_or_404(Eval.objects.for_org(request.organization), pk=eval_id)
    runs = side_by_side.runs_side_by_side(evaluation)
    page = Paginator(side_by_side.scored_indexes(runs), EXAMPLES_PER_PAGE).get_page(request.GET.get("page"))
    context = {
        "evaluation": evaluation, "summaries": side_by_side.summaries(evaluation, runs), "page": page,
        "examples": side_by_side.examples(evaluation, runs, list(page)), "older_runs": evaluation.runs.count() - len(runs),
        "live_refresh_seconds": LIVE_REFRESH_SECONDS if any(not run.is_finished for run in runs) else None,
    }
    return render(request, "dashboard/eval.html", context)


@require_POST
@with_organization
def eval_run_cancel(request: OrganizationRequest, eval_id: str, run_id: str) -> HttpResponse:
    run = get_object_or_404(EvalRun.objects.for_org(request.organization), pk=run_id, eval_id=eval_id)
    was_finished = run.is_finished
    run = run_status.cancel(run)
    if was_finished:
        messages.error(request, f"{run.name} had already finished ({run.status}): there was nothing to cancel.")
    else:
        messages.success(request, f"{run.name} is canceled: it stops at its next batch, and keeps the answers scored so far.")
    return redirect("dashboard:eval", eval_id=eval_id)


@require_POST
@with_organization
def model_compare_base(request: OrganizationRequest, model_name: str) -> HttpResponse:
    """The models page's "Compare with base": runs for the base model and the fine-tune on an eval."""
    return _start_comparison(request, model_name, model_comparisons.compare_with_base)


@require_POST
@with_organization
def model_compare_revisions(request: OrganizationRequest, model_name: str) -> HttpResponse:
    """The models page's "Compare revisions": a run for each revision, pinned ``@r<N>``."""
    return _start_comparison(request, model_name, model_comparisons.compare_revisions)


def _start_comparison(request: OrganizationRequest, model_name: str, start: StartComparison) -> HttpResponse:
    """Started, then the eval's page; refused (the API's refusal, nothing started), the models page saying why."""
    model = get_object_or_404(FineTunedModel.objects.for_org(request.organization), name=model_name)
    form = CompareForm(request.POST, evals=eval_choices(request.organization))
    if not form.is_valid():
        messages.error(request, " ".join(str(error) for error in form.errors["eval"]))
        return redirect("dashboard:models")
    evaluation = Eval.objects.for_org(request.organization).get(pk=form.cleaned_data["eval"])
    try:
        runs = start(request.organization, request.user, evaluation, model)
    except ApiError as error:
        messages.error(request, error.message)
        return redirect("dashboard:models")
    models = ", ".join(run.model for run in runs)
    messages.success(request, f"Started {len(runs)} runs of {evaluation.name}: {models}.")
    return redirect("dashboard:eval", eval_id=evaluation.id)
