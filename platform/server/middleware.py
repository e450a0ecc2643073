"""The platform's own Django middleware."""

from __future__ import annotations

from django.core.exceptions import BadRequest, PermissionDenied, SuspiciousOperation
from django.http import Http404, HttpRequest, HttpResponse
from django.http.multipartparser import MultiPartParserError
from django.utils.deprecation import MiddlewareMixin
from django.utils.log import log_response

from base.database_outage import as_api_error
from base.error_responses import (
    api_error,
    bad_request,
    for_api,
    page_not_found,
    permission_denied,
    server_error,
    unavailable,
)
from core.api_errors import ApiError


class RefuseNulInAddress(MiddlewareMixin):
    """A NUL character in the path or the query string is a 400 before any view looks it up:
    PostgreSQL refuses NUL in any text, a lookup by id included, so ``/v1/files/%00`` or
    ``?after=%00`` would otherwise be a 500 there (and nothing a tenant names holds one). Bodies
    are checked where they are parsed (``core.strict_json``, the forms' and serializers' fields)."""

    def process_request(self, request: HttpRequest) -> HttpResponse | None:
        if "\x00" not in request.path and "%00" not in request.META.get("QUERY_STRING", ""):
            return None
        if for_api(request):
            return api_error(ApiError("The request's path or query string holds a NUL character (%00).", code="invalid_url"))
        return bad_request(request, ValueError("NUL in the address"))


class ViewExceptionMiddleware(MiddlewareMixin):
    """What a view's exception answers, in every mode: a database outage is a 503
    (``base.database_outage``), not a 500; under /v1/ anything else is JSON in the API's shape,
    even with DEBUG=true, where Django would show an API client its HTML debug page (with the
    traceback and the settings). The DRF views' own exceptions are shaped by
    ``base.error_responses`` first; what it leaves, a bug, arrives here.

    Only ``process_exception``: MiddlewareMixin then serves async views (the gateway's) without a
    hop to a thread."""

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        error = as_api_error(exception)
        if error is not None:
            return unavailable(request, error)
        if not for_api(request):
            return None  # Django's own handling: its debug pages in development, base.error_responses in production
        response = _api_answer(request, exception)
        # Logged as Django logs the exceptions it handles itself: with the traceback and the request.
        log_response(
            "%s: %s", response.reason_phrase, request.path, response=response, request=request, exception=exception
        )
        return response


def _api_answer(request: HttpRequest, exception: Exception) -> HttpResponse:
    """The status Django would give the exception, with the API's body."""
    if isinstance(exception, Http404):
        return page_not_found(request, exception)
    if isinstance(exception, PermissionDenied):
        return permission_denied(request, exception)
    if isinstance(exception, (BadRequest, SuspiciousOperation, MultiPartParserError)):
        return bad_request(request, exception)
    return server_error(request)
