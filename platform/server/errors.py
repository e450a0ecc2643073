"""Django's error pages: JSON in the API's shape under /v1/, a page for people elsewhere."""

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.template.loader import render_to_string

from core.api_errors import ApiError
from server.api_errors import json_404


def _for_api(request: HttpRequest) -> bool:
    return request.path.startswith("/v1/")


def not_found(request, exception=None):
    if _for_api(request):
        return json_404(request, exception)
    return render(request, "404.html", {"path": request.path}, status=404)


def unavailable(request: HttpRequest, error: ApiError) -> HttpResponse:
    """A part the platform needs is down for a while (``error`` says which, and when to retry)."""
    if _for_api(request):
        response = JsonResponse(error.body(), status=error.status)
    else:
        # Rendered without the request: its context processors would read the session and the
        # signed-in user, from the very database that is down.
        response = HttpResponse(render_to_string("503.html", {"message": error.message}), status=error.status)
    for name, value in error.headers().items():
        response[name] = value
    return response
