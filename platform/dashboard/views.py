"""Dashboard pages. Each view parses a form, calls the same service the API calls, and renders."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.core.paginator import Page, Paginator
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, JsonResponse, QueryDict
from django.http.response import HttpResponseBase
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from accounts.models import ApiKey, Organization
from accounts.permissions import allow_members_to_manage, check_may_manage_models, is_owner, may_manage, may_revoke
from accounts.services import create_api_key, revoke_api_key
from base.error_responses import api_error
from base.serving_client import PoolUnavailable, serving
from core.api_errors import ApiError, logged_instead
from core.datasets import Example
from core.object_store import ObjectNotFound
from core.strict_json import MAX_INT
from core.whole_numbers import whole_number
from dashboard.forms import AdapterUploadForm, ApiKeyForm, ComposeForm, JobForm, UploadForm, show_api_error
from dashboard.eval_pages import eval_choices
from dashboard.organizations import OrganizationRequest, switch_organization, with_organization
from dashboard.playground import completion_body
from dashboard.usage_chart import daily_tokens_chart
from finetuning import adapters, compositions, files, job_creation, job_status, publishing
from finetuning.models import Composition, File, FineTunedModel, FineTuningJob
from finetuning.registry import delete_fine_tuned_model, list_usable_models, resolve_model
from finetuning.representations import event_object, job_object
from gateway import metrics as gateway_metrics
from gateway.completions import complete_for_organization, pool_response
from usage.report import daily_usage

PREVIEW_EXAMPLES = 5
JOB_PAGE_EXAMPLES = 2  # enough to see what a job trains on, tool calls and all
MAX_ID = MAX_INT  # the largest row number or count a form or query may name: what the database holds
PAGE_SIZE = 50
USAGE_PERIODS = (7, 14, 30)  # days the usage page can show
RECENT_COMPOSITIONS = 10  # on the models page; the API lists them all


def _posted(request: HttpRequest) -> QueryDict | None:
    """A form's data when it was sent, even empty (so that it says what is missing), else None."""
    return request.POST if request.method == "POST" else None


def _page(request: HttpRequest, queryset: QuerySet[Any]) -> Page[Any]:
    """The ``?page=`` of a newest-first listing; an unusable number gives the nearest real page."""
    return Paginator(queryset, PAGE_SIZE).get_page(request.GET.get("page"))


@require_POST
@with_organization
def switch(request: OrganizationRequest) -> HttpResponse:
    # Not a number, or not one of the user's organizations: the same refusal (403).
    chosen = whole_number(request.POST.get("organization", ""), 1, MAX_ID) or 0
    organization = switch_organization(request, chosen)
    messages.info(request, f"Now working in {organization.name}.")
    return redirect("dashboard:jobs")


@with_organization
def datasets(request: OrganizationRequest) -> HttpResponse:
    line_errors: object  # a refused dataset's per-line errors, for the template
    form, line_errors = UploadForm(), []
    if request.method == "POST":
        form = UploadForm(request.POST, request.FILES)
        if form.is_valid():
            upload = form.cleaned_data["file"]
            try:
                created = files.upload_file(request.organization, request.user, upload, files.PURPOSE)
            except ApiError as error:
                show_api_error(form, error)
                line_errors = error.extra.get("errors", [])
            else:
                messages.success(request, f"{created.filename}: {created.example_count} examples, ready to train.")
                return redirect("dashboard:dataset", file_id=created.id)
    page = _page(request, File.objects.for_org(request.organization))
    return render(request, "dashboard/datasets.html", {"form": form, "page": page, "line_errors": line_errors})


@with_organization
def dataset(request: OrganizationRequest, file_id: str) -> HttpResponse:
    file = get_object_or_404(File.objects.for_org(request.organization), pk=file_id)
    preview = files.first_examples(file, PREVIEW_EXAMPLES)
    return render(request, "dashboard/dataset.html", {"file": file, "preview": preview})


@require_POST
@with_organization
def dataset_delete(request: OrganizationRequest, file_id: str) -> HttpResponse:
    file = get_object_or_404(File.objects.for_org(request.organization), pk=file_id)
    try:
        files.delete_file(file)
    except ApiError as error:
        messages.error(request, error.message)
        return redirect("dashboard:dataset", file_id=file_id)
    messages.success(request, f"Deleted {file.filename}.")
    return redirect("dashboard:datasets")


@with_organization
def usage(request: OrganizationRequest) -> HttpResponse:
    """Completions and trained tokens by model, a bar a day: what ``/v1/organization/usage/*`` reports."""
    days = int(request.GET["days"]) if request.GET.get("days") in {str(days) for days in USAGE_PERIODS} else 14
    report = daily_usage(request.organization, days)
    context = {"chart": daily_tokens_chart(report.completions), "totals": report.totals, "days": days, "periods": USAGE_PERIODS}
    return render(request, "dashboard/usage.html", context)


@with_organization
def job_list(request: OrganizationRequest) -> HttpResponse:
    page = _page(request, FineTuningJob.objects.for_org(request.organization))
    return render(request, "dashboard/jobs.html", {"page": page})


@with_organization
def job_new(request: OrganizationRequest) -> HttpResponse:
    available = list(File.objects.for_org(request.organization))
    form = JobForm(_posted(request), files=available)
    if request.method == "POST" and form.is_valid():
        try:
            job = job_creation.create_job(request.organization, request.user, form.to_job_request())
        except ApiError as error:
            show_api_error(form, error)
        else:
            messages.success(request, f"Fine-tune {job.suffix} is queued.")
            return redirect("dashboard:job", job_id=job.id)
    return render(request, "dashboard/job_new.html", {"form": form, "has_files": bool(available)})


@with_organization
def job_detail(request: OrganizationRequest, job_id: str) -> HttpResponse:
    job = get_object_or_404(FineTuningJob.objects.for_org(request.organization), pk=job_id)
    context = {
        "job": job, "checkpoints": job.checkpoints.all(), "base_url": request.build_absolute_uri("/v1"),
        "examples": _training_examples(request.organization, job.training_file),
    }
    return render(request, "dashboard/job.html", context)


def _training_examples(organization: Organization, file_id: str) -> list[Example]:
    """The first examples of a job's training file, shown on its page; none once the file is deleted
    (or its content is gone from storage: the page still shows the job)."""
    file = File.objects.for_org(organization).filter(pk=file_id).first()
    try:
        return files.first_examples(file, JOB_PAGE_EXAMPLES) if file else []
    except ObjectNotFound:
        return []


@with_organization
def checkpoint_adapter(request: OrganizationRequest, job_id: str, checkpoint_id: str) -> HttpResponseBase:
    """A checkpoint's adapter as the API serves it (``GET /v1/fine_tuning/jobs/{id}/checkpoints/{ckpt}/adapter``)."""
    job = get_object_or_404(FineTuningJob.objects.for_org(request.organization), pk=job_id)
    checkpoint = get_object_or_404(job.checkpoints.select_related("job"), pk=checkpoint_id)
    try:
        archive = adapters.checkpoint_archive(checkpoint)
    except ApiError as error:
        messages.error(request, error.message)
        return redirect("dashboard:job", job_id=job_id)
    return adapters.archive_response(archive, checkpoint.name)


@with_organization
def job_progress(request: OrganizationRequest, job_id: str) -> JsonResponse:
    """What the job page polls: the job, the metrics reports it has not seen yet (from the
    ``metrics_from``-th on, so a long job's poll stays small), and the latest messages."""
    job = get_object_or_404(FineTuningJob.objects.for_org(request.organization).select_related("organization"), pk=job_id)
    seen = whole_number(request.GET.get("metrics_from", "0"), 0, MAX_ID)
    if seen is None:
        return JsonResponse({"error": "metrics_from must be a whole number of reports already seen"}, status=400)
    reports = list(job.events.filter(type="metrics").order_by("created_at", "pk")[seen:])
    # Training steps only: an evaluation's scores are metrics too, shown in a section of their own.
    metrics = [event.data for event in reports if event.data and "step" in event.data]
    latest = [event_object(event) for event in job.events.all()[:50]]
    return JsonResponse(
        {"job": job_object(job), "metrics": metrics, "metrics_count": seen + len(reports), "events": latest}
    )


@require_POST
@with_organization
def job_cancel(request: OrganizationRequest, job_id: str) -> HttpResponse:
    job = get_object_or_404(FineTuningJob.objects.for_org(request.organization), pk=job_id)
    try:
        job_status.cancel_job(job)
        messages.success(request, "The job is cancelled.")
    except ApiError as error:
        messages.error(request, error.message)
    return redirect("dashboard:job", job_id=job_id)


@with_organization
def models(request: OrganizationRequest) -> HttpResponse:
    """Every usable model with, for a fine-tuned one, its job and dataset; and whether it runs, where."""
    own = FineTunedModel.objects.for_org(request.organization).select_related("job").prefetch_related("revisions__job")
    fine_tuned = {model.name: model for model in own}
    datasets = File.objects.for_org(request.organization).in_bulk([model.job.training_file for model in fine_tuned.values() if model.job])
    try:
        running, pool_problem = serving(), None
    except PoolUnavailable as exc:
        running, pool_problem = None, logged_instead("the inference pool did not answer the models page", str(exc))
    rows = []
    for model in list_usable_models(request.organization):
        lineage = fine_tuned.get(model.name)
        dataset = datasets.get(lineage.job.training_file) if lineage and lineage.job else None
        rows.append((model, lineage, dataset, running.of(model) if running else None))
    # A composed model's parents are linked while they exist; they may be deleted before it.
    recent = list(Composition.objects.for_org(request.organization)[:RECENT_COMPOSITIONS])
    # Rolling back and deleting are for managers (``accounts.permissions``): others are not offered them.
    context = {
        "models": rows, "pool_problem": pool_problem, "present": set(fine_tuned), "compositions": recent,
        "composing": any(not composition.is_finished for composition in recent),
        "may_manage_models": may_manage(request.organization, request.user),
        "evals": eval_choices(request.organization),  # to compare a fine-tune on
    }
    return render(request, "dashboard/models.html", context)


@require_POST
@with_organization
def model_delete(request: OrganizationRequest, model_name: str) -> HttpResponse:
    model = get_object_or_404(FineTunedModel.objects.for_org(request.organization), name=model_name)
    check_may_manage_models(request.organization, request.user, "delete")  # a 403 page when refused
    delete_fine_tuned_model(model)
    messages.success(request, f"Deleted {model.name}; it is no longer served.")
    return redirect("dashboard:models")


@require_POST
@with_organization
def model_rollback(request: OrganizationRequest, model_name: str) -> HttpResponse:
    """The models page's "Answer with" button: ``POST /v1/fine_tuning/models/{model}/rollback``."""
    model = get_object_or_404(FineTunedModel.objects.for_org(request.organization), name=model_name)
    check_may_manage_models(request.organization, request.user, "roll back")  # a 403 page when refused
    number = whole_number(request.POST.get("revision", ""), 1, MAX_ID)
    try:
        if number is None:
            raise ApiError(f"Choose a revision of {model.name} to answer with.", param="revision")
        model = publishing.roll_back(model, number)
    except ApiError as error:
        messages.error(request, error.message)
    else:
        messages.success(request, f"{model.name} answers with r{model.revision} from now on.")
    return redirect("dashboard:models")


@with_organization
def model_adapter(request: OrganizationRequest, model_name: str) -> HttpResponseBase:
    """A fine-tuned model's adapter as the API serves it (``GET /v1/fine_tuning/models/{model}/adapter``)."""
    model = get_object_or_404(FineTunedModel.objects.for_org(request.organization), name=model_name)
    try:
        archive = adapters.model_archive(model)
    except ApiError as error:  # not published (any more), or its store does not answer
        messages.error(request, error.message)
        return redirect("dashboard:models")
    return adapters.archive_response(archive, model.name)


@with_organization
def adapter_upload(request: OrganizationRequest) -> HttpResponse:
    """An adapter trained elsewhere, served as ``<model>:<suffix>`` once checked, as ``POST
    /v1/fine_tuning/adapters`` does. Any member may, as through the API; a refusal (the archive, its
    shapes, the suffix, the size, a quota) is shown on the form with the API's status (a 400 for a
    bad archive), and then nothing was written."""
    form, status = AdapterUploadForm(), 200
    if request.method == "POST":
        form, status = AdapterUploadForm(request.POST, request.FILES), 400
        if form.is_valid():
            data = form.cleaned_data
            try:
                model = adapters.upload_adapter(
                    request.organization, request.user, data["file"], data["model"], data["suffix"] or None
                )
            except ApiError as error:
                show_api_error(form, error)
                status = error.status
            else:
                messages.success(request, f"{model.name} is published: it answers on its first request.")
                return redirect("dashboard:models")
    return render(request, "dashboard/adapter_upload.html", {"form": form}, status=status)


@with_organization
def model_compose(request: OrganizationRequest) -> HttpResponse:
    """A new model from a weighted combination of the organization's fine-tuned models, as ``POST
    /v1/fine_tuning/models`` makes it. A refusal is shown on the form, and then nothing was written;
    one the API answers 404 (a model the organization cannot see) is a 404 here too. ``linear`` is
    published at once; the other methods are queued, and the models page shows their status."""
    names = list(FineTunedModel.objects.for_org(request.organization).values_list("name", flat=True))
    form, status = ComposeForm(_posted(request), models=names), 200
    if request.method == "POST" and form.is_valid():
        try:
            result = compositions.compose_or_queue(request.organization, request.user, form.to_composition())
        except ApiError as error:
            show_api_error(form, error)
            status = 404 if error.status == 404 else 200
        else:
            if isinstance(result, FineTunedModel):
                approximation = f"approximation error {result.lineage['approximation_error']:.4g}"
                messages.success(request, f"{result.name} is published ({approximation}): it answers on its first request.")
            else:
                status_note = "its status is under Compositions below"
                messages.info(request, f"{result.model} is being composed ({result.method}) on a worker: {status_note}.")
            return redirect("dashboard:models")
    return render(request, "dashboard/model_compose.html", {"form": form}, status=status)


@with_organization
def playground(request: OrganizationRequest) -> HttpResponse:
    """One pane, or two side by side (``?compare=1``). The first pane starts on ``?model=``, else on
    the newest fine-tune; the second on its base model, the comparison people want first."""
    usable = list_usable_models(request.organization)  # base models, then fine-tunes newest first
    names = [model.name for model in usable]
    newest = next((model for model in usable if model.suffix), usable[0])
    asked = request.GET.get("model", "")
    # A name not listed may still be usable: a revision pinned with @rN, or a checkpoint.
    first = next((model for model in usable if model.name == asked), None) or resolve_model(request.organization, asked) or newest
    if first.name not in names:
        names.append(first.name)
    second = first.base_model_id if first.suffix else names[0]
    context = {"models": names, "panes": [first.name, second], "compare": bool(request.GET.get("compare"))}
    return render(request, "dashboard/playground.html", context)


@require_POST
@with_organization
async def playground_chat(request: OrganizationRequest) -> HttpResponseBase:
    """The playground's chat: checked, then streamed from the pool as server-sent events."""
    try:
        answer = await complete_for_organization(request.organization, completion_body(request.body), "chat/completions")
        response = pool_response(answer)
    except ApiError as exc:
        response = api_error(exc)
    gateway_metrics.REQUESTS.labels("playground", str(response.status_code)).inc()
    return response


@with_organization
def api_keys(request: OrganizationRequest) -> HttpResponse:
    form, new_key = ApiKeyForm(_posted(request)), None
    if request.method == "POST" and form.is_valid():
        _, new_key = create_api_key(request.organization, request.user, form.cleaned_data["name"])
        form = ApiKeyForm()
    listing = ApiKey.objects.filter(organization=request.organization).order_by("-created_at")
    context = {"form": form, "keys": listing, "new_key": new_key, "is_owner": is_owner(request.organization, request.user)}
    return render(request, "dashboard/api_keys.html", context)


@require_POST
@with_organization
def api_key_revoke(request: OrganizationRequest, key_prefix: str) -> HttpResponse:
    api_key = get_object_or_404(ApiKey.objects.filter(organization=request.organization), prefix=key_prefix)
    if not may_revoke(api_key, request.user):
        raise PermissionDenied("Members revoke their own keys; only an owner can revoke another's, unless an owner allows members to.")
    revoke_api_key(api_key)
    messages.success(request, f"Revoked key {api_key.name} ({api_key.prefix}…).")
    return redirect("dashboard:api_keys")


@require_POST
@with_organization
def members_may_manage(request: OrganizationRequest) -> HttpResponse:
    allowed = request.POST.get("allowed") == "on"
    allow_members_to_manage(request.organization, request.user, allowed)
    messages.success(request, "Members may now revoke any key and delete models." if allowed else "Only owners may now revoke others' keys and delete models.")
    return redirect("dashboard:api_keys")
