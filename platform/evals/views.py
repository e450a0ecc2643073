"""The evals API (``/v1/evals``, OpenAI's paths): views parse, call one function of the app, shape.
Another organization's eval, run or item is "no such ..." (404), as everywhere."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.authentication import caller_of, organization_of
from base.pagination import list_page
from core.api_errors import ApiError, not_found, object_body, shown
from evals import creation, run_status
from evals.models import Eval, EvalRun, OutputItem, RunStatus
from evals.representations import eval_object, output_item_object, run_object
from base.api_views import PAGE_PARAMETERS, owned, parsed, path_only
from evals.requests import EvalCreate, EvalUpdate, RunCreate

ITEM_STATUSES = ("pass", "fail", "error")


def _own_eval(request: Request, eval_id: str) -> Eval:
    return owned(Eval, organization_of(request), "eval", eval_id)


def _own_run(request: Request, eval_id: str, run_id: str) -> EvalRun:
    return owned(EvalRun, organization_of(request), "eval run", run_id, eval_id=eval_id)


def _site(request: Request) -> str:
    """Where the caller reached us (``https://host``): a run's ``report_url`` starts with it."""
    return request.build_absolute_uri("/").removesuffix("/")


def _status_filter(request: Request, allowed: tuple[str, ...]) -> str | None:
    status = request.query_params.get("status")
    if status is not None and status not in allowed:
        raise ApiError(f"status must be one of {', '.join(allowed)}, not '{shown(status)}'", param="status")
    return status


class EvalListView(APIView):
    """``/v1/evals``: create an eval; list the organization's, newest first."""

    @extend_schema(operation_id="v1_evals_list", responses=OpenApiTypes.OBJECT, parameters=PAGE_PARAMETERS)
    def get(self, request: Request) -> Response:
        return Response(list_page(request.query_params, Eval.objects.for_org(organization_of(request)), eval_object))

    @extend_schema(
        request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT, summary="Create an eval: a file and its graders"
    )
    def post(self, request: Request) -> Response:
        body = parsed(EvalCreate, object_body(request.data))
        return Response(eval_object(creation.create_eval(organization_of(request), caller_of(request), body)))


class EvalDetailView(APIView):
    """``/v1/evals/{eval_id}``: retrieve, rename (name, metadata), delete (with its runs)."""

    @path_only
    def get(self, request: Request, eval_id: str) -> Response:
        return Response(eval_object(_own_eval(request, eval_id)))

    @extend_schema(
        operation_id="v1_evals_update",
        request=OpenApiTypes.OBJECT,
        responses=OpenApiTypes.OBJECT,
        summary="Update an eval's name or metadata",
    )
    def post(self, request: Request, eval_id: str) -> Response:
        body = parsed(EvalUpdate, object_body(request.data))
        evaluation = _own_eval(request, eval_id)
        changed = body.model_dump(exclude_unset=True)
        if not changed:
            raise ApiError("Nothing to update: give name, metadata or both.", param="name", code="invalid_body")
        for field, value in changed.items():
            setattr(evaluation, field, value)
        evaluation.save(update_fields=[*changed, "updated_at"])
        return Response(eval_object(evaluation))

    @path_only
    def delete(self, request: Request, eval_id: str) -> Response:
        _own_eval(request, eval_id).delete()  # its runs too: a worker scoring one stops at its next batch
        return Response({"object": "eval.deleted", "deleted": True, "eval_id": eval_id})


class RunListView(APIView):
    """``/v1/evals/{eval_id}/runs``: start runs (one per model named); list the eval's, newest first."""

    @extend_schema(
        operation_id="v1_evals_runs_list", responses=OpenApiTypes.OBJECT,
        parameters=[*PAGE_PARAMETERS, OpenApiParameter("status", str, enum=list(RunStatus.values))],
    )
    def get(self, request: Request, eval_id: str) -> Response:
        runs = _own_eval(request, eval_id).runs.all()
        if status := _status_filter(request, tuple(RunStatus.values)):
            runs = runs.filter(status=status)
        site = _site(request)
        return Response(list_page(request.query_params, runs, lambda run: run_object(run, site)))

    @extend_schema(
        request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT,
        summary="Start a run of the eval for data_source.model, and one for each of models (ours): the first, with all in runs",
    )
    def post(self, request: Request, eval_id: str) -> Response:
        body = parsed(RunCreate, object_body(request.data))
        evaluation = _own_eval(request, eval_id)
        runs = creation.start_runs(organization_of(request), caller_of(request), evaluation, body)
        site = _site(request)
        return Response(run_object(runs[0], site) | {"runs": [run_object(run, site) for run in runs]})


class RunDetailView(APIView):
    """``/v1/evals/{eval_id}/runs/{run_id}``: retrieve (with its progress), delete."""

    @path_only
    def get(self, request: Request, eval_id: str, run_id: str) -> Response:
        return Response(run_object(_own_run(request, eval_id, run_id), _site(request)))

    @path_only
    def delete(self, request: Request, eval_id: str, run_id: str) -> Response:
        _own_run(request, eval_id, run_id).delete()
        return Response({"object": "eval.run.deleted", "deleted": True, "run_id": run_id})


class RunCancelView(APIView):
    """``POST /v1/evals/{eval_id}/runs/{run_id}/cancel``: its worker stops at its next batch."""

    @path_only
    def post(self, request: Request, eval_id: str, run_id: str) -> Response:
        return Response(run_object(run_status.cancel(_own_run(request, eval_id, run_id)), _site(request)))


class OutputItemListView(APIView):
    """``/v1/evals/{eval_id}/runs/{run_id}/output_items``: each example's prompt, expected and given
    answers and verdicts, newest first."""

    @extend_schema(
        operation_id="v1_evals_runs_output_items_list", responses=OpenApiTypes.OBJECT,
        parameters=[*PAGE_PARAMETERS, OpenApiParameter("status", str, enum=list(ITEM_STATUSES))],
    )
    def get(self, request: Request, eval_id: str, run_id: str) -> Response:
        run = _own_run(request, eval_id, run_id)
        items = run.output_items.all()
        if status := _status_filter(request, ITEM_STATUSES):
            items = items.filter(status=status)
        return Response(list_page(request.query_params, items, lambda item: output_item_object(item, run)))


class OutputItemDetailView(APIView):
    @path_only
    def get(self, request: Request, eval_id: str, run_id: str, item_id: str) -> Response:
        run = _own_run(request, eval_id, run_id)
        item = OutputItem.objects.filter(run=run, pk=item_id).first()
        if item is None:
            raise not_found("output item", item_id)
        return Response(output_item_object(item, run))
