"""The one error a client of this platform sees, in OpenAI's shape, for every API and process.

``{"error": {"message", "type", "param", "code", ...}}``. Django-free, so the inference pool, the
gateway and the fine-tuning API raise the same class: ``inference.errors`` makes the inference
ones, ``server.api_errors`` translates DRF's own exceptions into it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import Send

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
SERVER = "server_error"
UNAVAILABLE = "service_unavailable_error"


class ApiError(Exception):
    """``extra`` adds fields to the error object (a dataset's per-line ``errors``); ``retry_after_s``
    says when a temporary outage is worth retrying (the ``Retry-After`` header, see ``headers``)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
        **extra: object,
    ):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code, self.extra = message, status, type, param, code, extra
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code, **self.extra)

    def headers(self) -> dict[str, str]:
        """The HTTP headers that go with the body."""
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()

    def __str__(self) -> str:
        return f"{self.status} {self.code or self.type}: {self.message}"


async def send_asgi(error: ApiError, send: Send, close_connection: bool = False) -> None:
    """Answer ``error`` on a raw ASGI connection, for the layers that stand in front of any
    framework (the body-size cap, the internal-token guard). ``close_connection``: the request's
    body was left unread, so the connection cannot carry another request."""
    body = error.json_bytes()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in error.headers().items()]
    if close_connection:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def error_body(
    message: str, *, type: str, param: str | None = None, code: str | None = None, **extra: object
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code, **extra}}


def internal_error() -> ApiError:
    """What a client learns of a bug: that it happened, never its traceback or the settings (those
    go to the server's log)."""
    return ApiError(
        "The server had an error while processing your request; it has been logged.",
        status=500, type=SERVER, code="internal_error",
    )  # fmt: skip
