"""The REST API's errors: domain code raises ``core.api_errors.ApiError``; DRF's own exceptions (bad
JSON, bad auth, unknown ids) and a database outage (``server.database_outage``) are translated by
``exception_handler`` so every API answer has the same shape.
"""

from __future__ import annotations

from django.http import Http404, JsonResponse
from rest_framework import exceptions, status
from rest_framework.response import Response

from core.api_errors import ApiError, error_body
from server.database_outage import as_api_error


def not_found(what: str, ident: str, param: str | None = None) -> ApiError:
    return ApiError(f"No such {what}: '{ident}'", status=404, param=param, code=f"{what.replace(' ', '_')}_not_found")


def _first_validation_error(detail, path: str = "") -> tuple[str | None, str]:
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


def exception_handler(exc, context) -> Response | None:
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


def json_404(request, exception=None) -> JsonResponse:
    """Unknown URLs answer in the API's shape too (Django's handler404)."""
    return JsonResponse(
        error_body(f"Unknown path: {request.method} {request.path}", type="invalid_request_error", code="unknown_url"),
        status=404,
    )
