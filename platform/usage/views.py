"""``GET /v1/organization/usage/completions`` and ``.../fine_tuning``: the caller's organization's
usage, in OpenAI's usage API shape (``usage.report``)."""

from __future__ import annotations

from collections.abc import Callable

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.authentication import organization_of
from usage import report

_PARAMETERS = [
    OpenApiParameter("start_time", int, required=True, description="Start of the first bucket, Unix seconds"),
    OpenApiParameter("end_time", int, description="End of the range (exclusive), Unix seconds; default now"),
    OpenApiParameter("bucket_width", str, enum=list(report.WIDTHS), description="Default 1d"),
    OpenApiParameter("group_by", str, many=True, description="model (and, for completions, api_key_id and batch)"),
    OpenApiParameter("models", str, many=True, description="Only these models"),
    OpenApiParameter("limit", int, description="Buckets a page holds (1d: 7, at most 31; 1h: 24, 168; 1m: 60, 1440)"),
    OpenApiParameter("page", str, description="A response's next_page"),
]


class _UsageView(APIView):
    source: report.Source

    def get(self, request: Request) -> Response:
        query = report.parse_query(request.query_params, self.source)
        return Response(report.usage_page(organization_of(request), self.source, query))


def _documented(summary: str) -> Callable[[type[_UsageView]], type[_UsageView]]:
    return extend_schema(responses=OpenApiTypes.OBJECT, parameters=_PARAMETERS, summary=summary)


@_documented("Completions served to the organization: requests, input and output tokens, by time bucket")
class CompletionsUsageView(_UsageView):
    source = report.COMPLETIONS


@_documented("Tokens the organization's succeeded fine-tuning jobs trained on, by the time bucket they finished in")
class FineTuningUsageView(_UsageView):
    source = report.FINE_TUNING
