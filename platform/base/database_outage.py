"""A database that cannot be reached (restarting, failing over, a network blip) is a temporary
outage, not a bug: callers get a 503 that says to retry, with ``Retry-After``, never a 500.

The translation is ``as_api_error``, here once. Three doors use it: the DRF exception handler (API
views see their exceptions there first), ``server.middleware.ViewExceptionMiddleware`` (every other
Django view: JSON under /v1/, a page for people elsewhere), and the gateway's ORM calls
(``gateway.access``: the ASGI fast path serves completions outside Django's middleware).

A value the database refuses to hold or compare (``DataError``: a NUL character in PostgreSQL text,
a number out of range) is the caller's to fix: a 400 saying so, never a 500. It is translated here
too, so the same three doors answer it.

Recovery needs nothing here: a request's connection that failed is closed by Django at the next
request (``close_old_connections`` with ``CONN_HEALTH_CHECKS``), and the next query connects again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast

from django.db import DataError, InterfaceError, OperationalError

from core.api_errors import UNAVAILABLE, ApiError

log = logging.getLogger(__name__)

# Raised when the server cannot be reached or the connection broke; a bad query raises others
# (ProgrammingError, IntegrityError, ...), which stay bugs or are the caller's to handle.
DATABASE_ERRORS = (OperationalError, InterfaceError)
RETRY_AFTER_S = 5


def as_api_error(exc: BaseException) -> ApiError | None:
    """The 503 a database outage answers, the 400 a value the database refuses; None for anything else."""
    if isinstance(exc, DataError):
        return ApiError(
            "A value in this request cannot be stored or looked up: it holds a character or a number the "
            f"database does not accept (such as a NUL character) ({str(exc).splitlines()[0]}). Remove it and retry.",
        )
    if not isinstance(exc, DATABASE_ERRORS):
        return None
    log.warning("the database is unreachable: %s", exc)
    return ApiError(
        "The database is unreachable for the moment; this is temporary: retry the request in a few seconds.",
        status=503, type=UNAVAILABLE, code="database_unavailable", retry_after_s=RETRY_AFTER_S,
    )


@contextmanager
def outage_as_api_error() -> Iterator[None]:
    """For code that answers ``ApiError`` itself: a database outage inside becomes the 503."""
    try:
        yield
    except DATABASE_ERRORS as exc:
        raise cast(ApiError, as_api_error(exc)) from exc  # an outage's error is always the 503

