"""The webhooks API (``/v1/webhooks``): views parse, call one function of the app, shape. Another
organization's endpoint is "no such webhook endpoint" (404), as everywhere."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.authentication import caller_of, organization_of
from core.api_errors import object_body
from base.api_views import PAGE_PARAMETERS, owned, parsed, path_only
from base.pagination import list_page
from webhooks import endpoints
from webhooks.models import WebhookEndpoint
from webhooks.representations import delivery_object, endpoint_object
from webhooks.requests import EndpointCreate, EndpointUpdate


def _own_endpoint(request: Request, webhook_id: str) -> WebhookEndpoint:
    return owned(WebhookEndpoint, organization_of(request), "webhook endpoint", webhook_id)


class EndpointListView(APIView):
    """``/v1/webhooks``: register an endpoint (its secret is in this answer only); list the organization's."""

    @extend_schema(operation_id="v1_webhooks_list", responses=OpenApiTypes.OBJECT, parameters=PAGE_PARAMETERS)
    def get(self, request: Request) -> Response:
        endpoints_ = WebhookEndpoint.objects.for_org(organization_of(request))
        return Response(list_page(request.query_params, endpoints_, endpoint_object))

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT, summary="Register a webhook endpoint")
    def post(self, request: Request) -> Response:
        body = parsed(EndpointCreate, object_body(request.data))
        endpoint, secret = endpoints.register(organization_of(request), caller_of(request), **body.model_dump())
        return Response(endpoint_object(endpoint, secret))


class EndpointDetailView(APIView):
    """``/v1/webhooks/{webhook_id}``: retrieve, update (url, description, event_types, enabled), delete."""

    @path_only
    def get(self, request: Request, webhook_id: str) -> Response:
        return Response(endpoint_object(_own_endpoint(request, webhook_id)))

    @extend_schema(
        operation_id="v1_webhooks_update", request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT,
        summary="Update a webhook endpoint (url, description, event_types, enabled)",
    )
    def post(self, request: Request, webhook_id: str) -> Response:
        body = parsed(EndpointUpdate, object_body(request.data))
        endpoint = _own_endpoint(request, webhook_id)
        return Response(endpoint_object(endpoints.update(endpoint, body.model_dump(exclude_unset=True))))

    @path_only
    def delete(self, request: Request, webhook_id: str) -> Response:
        endpoints.remove(_own_endpoint(request, webhook_id))
        return Response({"object": "webhook_endpoint.deleted", "deleted": True, "id": webhook_id})


class DeliveryListView(APIView):
    """``/v1/webhooks/{webhook_id}/deliveries``: each event sent to the endpoint, newest first, with
    every attempt (status code or error, duration)."""

    @extend_schema(
        operation_id="v1_webhooks_deliveries_list", responses=OpenApiTypes.OBJECT, parameters=PAGE_PARAMETERS
    )
    def get(self, request: Request, webhook_id: str) -> Response:
        deliveries = (
            _own_endpoint(request, webhook_id).deliveries.select_related("event").prefetch_related("attempt_log")
        )
        return Response(list_page(request.query_params, deliveries, delivery_object))
