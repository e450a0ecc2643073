"""Errors as Django answers them: JSON in the API's shape under /v1/, a page for people elsewhere.

Domain code raises ``core.api_errors.ApiError``; ``api_error`` is its Django response. DRF's own
exceptions (bad JSON, bad auth, unknown ids) and a database outage (``base.database_outage``) are
translated by ``exception_handler``, so every API answer has the same shape.

Django uses the ``handler*`` views (``server.urls``) only with DEBUG=false; with DEBUG=true it shows
its debug pages instead. So /v1/ does not rely on them alone: an unknown path under /v1/ reaches
``unknown_api_path`` (a catch-all route) and an exception in a /v1/ view is answered by
``server.middleware.ViewExceptionMiddleware``, in every mode.
"""

from __future__ import annotations

import re
from typing import Any

from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.template.loader import render_to_string
from django.views import defaults
from django.views.debug import SafeExceptionReporterFilter
from django.views.decorators.csrf import csrf_exempt
from rest_framework import exceptions, status
from rest_framework.response import Response

from base.database_outage import as_api_error
from core.api_errors import ApiError, error_body, internal_error

API_PREFIX = "/v1/"


def api_error(error: ApiError) -> HttpResponse:
    """The one Django response for an ``ApiError``: its body, status and headers (Retry-After)."""
    return HttpResponse(error.json_bytes(), status=error.status, content_type="application/json", headers=error.headers())


def _first_validation_error(detail: object, path: str = "") -> tuple[str | None, str]:
    """DRF nests field errors; OpenAI names one param. Take the first, with its dotted path."""
    if isinstance(detail, dict):
        key, value = next(iter(detail.items()))
        name = path if key == "non_field_errors" else f"{path}.{key}" if path else str(key)
        return _first_validation_error(value, name)
    if isinstance(detail, list) and detail:
        return _first_validation_error(detail[0], path)
    return (path or None), str(detail)


def _translate(exc: exceptions.APIException) -> ApiError:
    if isinstance(exc, exceptions.ValidationError):
        param, message = _first_validation_error(exc.detail)
        return ApiError(f"{param}: {message}" if param else message, param=param)
    if isinstance(exc, exceptions.ParseError):
        return ApiError(f"We could not parse the body of your request: {exc.detail}", code="invalid_body")
    if isinstance(exc, (exceptions.NotAuthenticated, exceptions.AuthenticationFailed)):
        message = str(exc.detail)
        if isinstance(exc, exceptions.NotAuthenticated):
            message = "You didn't provide an API key. Use the header 'Authorization: Bearer <your API key>'."
        return ApiError(message, status=401, code="invalid_api_key")
    if isinstance(exc, exceptions.NotFound):
        return ApiError(str(exc.detail), status=404, code="not_found")
    return ApiError(str(exc.detail), status=exc.status_code, code=exc.default_code)


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, Http404):
        exc = exceptions.NotFound("Not found.")
    if isinstance(exc, exceptions.APIException):
        exc = _translate(exc)
    exc = as_api_error(exc) or exc
    if not isinstance(exc, ApiError):
        return None  # a bug: let Django report it as a 500
    headers = exc.headers()
    if exc.status == status.HTTP_401_UNAUTHORIZED:
        headers["WWW-Authenticate"] = "Bearer"
    return Response(exc.body(), status=exc.status, headers=headers)


def json_404(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    """Unknown URLs answer in the API's shape too (Django's handler404)."""
    return JsonResponse(
        error_body(f"Unknown path: {request.method} {request.path}", type="invalid_request_error", code="unknown_url"),
        status=404,
    )


def for_api(request: HttpRequest) -> bool:
    return request.path.startswith(API_PREFIX)


def page_not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if for_api(request):
        return json_404(request, exception)
    return render(request, "404.html", {"path": request.path}, status=404)


@csrf_exempt  # API clients send no CSRF token: an unknown POST is a 404, not a CSRF failure page
def unknown_api_path(request: HttpRequest) -> JsonResponse:
    return json_404(request)


def bad_request(request: HttpRequest, exception: Exception) -> HttpResponse:
    """A request Django refuses (a Host header not in ALLOWED_HOSTS, a body over its size limit, ...)."""
    if for_api(request):
        return JsonResponse(error_body("Bad request.", type="invalid_request_error", code="bad_request"), status=400)
    return defaults.bad_request(request, exception)


def permission_denied(request: HttpRequest, exception: Exception) -> HttpResponse:
    if for_api(request):
        body = error_body("You may not do this.", type="invalid_request_error", code="permission_denied")
        return JsonResponse(body, status=403)
    return defaults.permission_denied(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    """A bug (the traceback is in the log). Rendered without the request: its context processors
    read the session and the user, which may be what failed."""
    if for_api(request):
        return api_error(internal_error())
    return HttpResponse(render_to_string("500.html"), status=500)


def unavailable(request: HttpRequest, error: ApiError) -> HttpResponse:
    """A part the platform needs is down for a while (``error`` says which, and when to retry)."""
    if for_api(request):
        return api_error(error)
    # Rendered without the request: its context processors would read the session and the
    # signed-in user, from the very database that is down.
    response = HttpResponse(render_to_string("503.html", {"message": error.message}), status=error.status)
    for name, value in error.headers().items():
        response[name] = value
    return response


def too_large_page(message: str, back: str) -> str:
    """The page for a body refused as too large before Django ran (``server.body_limits``): there is
    no request, no session and no user to render with, only what to say and where to go back to."""
    return render_to_string("413.html", {"message": message, "back": back})


class SecretsHidingFilter(SafeExceptionReporterFilter):
    """Django's filter for debug pages and error reports, also hiding settings whose value is a URL or
    a backend: they may embed a password (CELERY_BROKER_URL, CELERY_RESULT_BACKEND, ...)."""

    hidden_settings = re.compile(SafeExceptionReporterFilter.hidden_settings.pattern + "|URL|BACKEND", flags=re.I)
