"""Django's error pages: JSON in the API's shape under /v1/, a page for people elsewhere.

Django uses the ``handler*`` views (``server.urls``) only with DEBUG=false; with DEBUG=true it shows
its debug pages instead. So /v1/ does not rely on them alone: an unknown path under /v1/ reaches
``unknown_api_path`` (a catch-all route) and an exception in a /v1/ view is answered by
``server.middleware.ViewExceptionMiddleware``, in every mode.
"""

import re

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.template.loader import render_to_string
from django.views import defaults
from django.views.decorators.csrf import csrf_exempt
from django.views.debug import SafeExceptionReporterFilter

from core.api_errors import ApiError, error_body, internal_error
from server.api_errors import json_404

API_PREFIX = "/v1/"


def for_api(request: HttpRequest) -> bool:
    return request.path.startswith(API_PREFIX)


def api_error(error: ApiError) -> JsonResponse:
    response = JsonResponse(error.body(), status=error.status)
    for name, value in error.headers().items():
        response[name] = value
    return response


def not_found(request, exception=None):
    if for_api(request):
        return json_404(request, exception)
    return render(request, "404.html", {"path": request.path}, status=404)


@csrf_exempt  # API clients send no CSRF token: an unknown POST is a 404, not a CSRF failure page
def unknown_api_path(request: HttpRequest) -> JsonResponse:
    return json_404(request)


def bad_request(request, exception=None):
    """A request Django refuses (a Host header not in ALLOWED_HOSTS, a body over its size limit, ...)."""
    if for_api(request):
        return JsonResponse(error_body("Bad request.", type="invalid_request_error", code="bad_request"), status=400)
    return defaults.bad_request(request, exception)


def permission_denied(request, exception=None):
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
