"""The Batch API (``/v1/batches``, OpenAI's paths): views parse, call one function of the app, shape.
Another organization's batch is "no such batch" (404), as everywhere."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.authentication import caller_of, organization_of
from batches import batch_status, creation
from batches.models import Batch
from batches.representations import batch_object
from batches.requests import BatchCreate
from core.api_errors import not_found, object_body
from evals.requests import parsed
from finetuning.pagination import list_page

_PAGE = [OpenApiParameter("after", str), OpenApiParameter("limit", int)]
_plain = extend_schema(request=None, responses=OpenApiTypes.OBJECT)  # a path's id, nothing else read


def _own_batch(request: Request, batch_id: str) -> Batch:
    batch = Batch.objects.for_org(organization_of(request)).filter(pk=batch_id).first()
    if batch is None:
        raise not_found("batch", batch_id)
    return batch


class BatchListView(APIView):
    """``/v1/batches``: create a batch from an uploaded file of requests; list the organization's, newest first."""

    @extend_schema(operation_id="v1_batches_list", responses=OpenApiTypes.OBJECT, parameters=_PAGE)
    def get(self, request: Request) -> Response:
        return Response(list_page(request.query_params, Batch.objects.for_org(organization_of(request)), batch_object))

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT, summary="Create a batch of requests")
    def post(self, request: Request) -> Response:
        body = parsed(BatchCreate, object_body(request.data))
        return Response(batch_object(creation.create_batch(organization_of(request), caller_of(request), body)))


class BatchDetailView(APIView):
    """``/v1/batches/{batch_id}``: its status, counts and files."""

    @_plain
    def get(self, request: Request, batch_id: str) -> Response:
        return Response(batch_object(_own_batch(request, batch_id)))


class BatchCancelView(APIView):
    """``POST /v1/batches/{batch_id}/cancel``: its worker stops at its next line boundary."""

    @_plain
    def post(self, request: Request, batch_id: str) -> Response:
        return Response(batch_object(batch_status.cancel(_own_batch(request, batch_id))))
