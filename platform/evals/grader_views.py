"""``/v1/fine_tuning/alpha/graders/{run,validate}`` (OpenAI's paths): views parse, call one function
of ``evals.grader_runs``, shape. ``run`` is asynchronous: it waits on a worker without holding a thread."""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from pydantic import BaseModel, ConfigDict, Field
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.authentication import organization_of
from base.api_views import parsed
from base.error_responses import api_error
from core import api_errors, strict_json
from evals import grader_runs
from gateway.access import authorize
from gateway.completions import bearer_key


class GraderRun(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    grader: Any  # checked by ``core.graders.spec``
    model_sample: str = Field(max_length=grader_runs.MAX_SAMPLE_CHARS)
    item: dict[str, Any] | None = None


class GraderValidate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    grader: Any


@csrf_exempt
async def run(request: HttpRequest) -> HttpResponse:
    """Score ``model_sample`` (and ``item``) with ``grader``: OpenAI's ``GraderRunResponse``."""
    try:
        if request.method != "POST":
            raise api_errors.method_not_allowed("POST")
        access = await authorize(bearer_key(request.headers.get("Authorization")), None)
        body = parsed(GraderRun, api_errors.object_body(strict_json.body(request.body)))
        grader = await sync_to_async(lambda: grader_runs.checked(access.api_key.organization, body.grader))()
        outcome = await grader_runs.run_on_worker(access.api_key.organization_id, grader, body.model_sample, body.item)
        return JsonResponse(grader_runs.run_response(grader, outcome))
    except api_errors.ApiError as exc:
        return api_error(exc)


class GraderValidateView(APIView):
    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT, summary="Check a grader without running it")
    def post(self, request: Request) -> Response:
        body = parsed(GraderValidate, request.data)
        return Response({"grader": grader_runs.checked(organization_of(request), body.grader)})
