"""The Batch API (``/v1/batches``, OpenAI's paths): views parse, call one function of the app, shape.
Another organization's batch is "no such batch" (404), as everywhere."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.authentication import caller_of, organization_of
from base.api_views import PAGE_PARAMETERS, owned, parsed, path_only
from base.pagination import list_page
from batches import batch_status, creation
from batches.models import Batch
from batches.representations import batch_object
from batches.requests import BatchCreate
from core.api_errors import object_body


def _own_batch(request: Request, batch_id: str) -> Batch:
    return owned(Batch, organization_of(request), "batch", batch_id)


class BatchListView(APIView):
    """``/v1/batches``: create a batch from an uploaded file of requests; list the organization's, newest first."""

    @extend_schema(operation_id="v1_batches_list", responses=OpenApiTypes.OBJECT, parameters=PAGE_PARAMETERS)
    def get(self, request: Request) -> Response:
        return Response(list_page(request.query_params, Batch.objects.for_org(organization_of(request)), batch_object))

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT, summary="Create a batch of requests")
    def post(self, request: Request) -> Response:
        body = parsed(BatchCreate, object_body(request.data))
        return Response(batch_object(creation.create_batch(organization_of(request), caller_of(request), body)))


class BatchDetailView(APIView):
    """``/v1/batches/{batch_id}``: its status, counts and files."""

    @path_only
    def get(self, request: Request, batch_id: str) -> Response:
        return Response(batch_object(_own_batch(request, batch_id)))


class BatchCancelView(APIView):
    """``POST /v1/batches/{batch_id}/cancel``: its worker stops at its next line boundary."""

    @path_only
    def post(self, request: Request, batch_id: str) -> Response:
        return Response(batch_object(batch_status.cancel(_own_batch(request, batch_id))))
