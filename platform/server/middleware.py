"""The platform's own Django middleware."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.utils.deprecation import MiddlewareMixin

from server.database_outage import as_api_error
from server.errors import unavailable


class DatabaseOutageMiddleware(MiddlewareMixin):
    """A view that hit a database outage answers 503 (``server.database_outage``), not 500.

    Only ``process_exception``: MiddlewareMixin then serves async views (the gateway's) without a
    hop to a thread."""

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        error = as_api_error(exception)
        return None if error is None else unavailable(request, error)
