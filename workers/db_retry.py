"""The trainer's database calls wait out a database outage (a restart, a fail-over, a network blip):
hours of training are worth more than the seconds the database takes to come back.

``retrying`` calls a function; when the database is unreachable, it closes this thread's broken
connection (outside a request nothing else does, and Django would use it for ever), waits with
backoff and calls again, for up to JOB_DATABASE_WAIT_SECONDS. After that the error goes up: the job
fails if that can be written, or is left with a stale heartbeat for the sweeper to recover.

A call retried after its connection broke may have been committed already: the writes that use it
are conditional on the attempt (a second ``succeed`` or ``fail`` changes nothing) or harmless twice
(an event).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from django.conf import settings
from django.db import connection

from base.database_outage import DATABASE_ERRORS

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

_FIRST_WAIT_S = 0.5
_LONGEST_WAIT_S = 10.0


def retrying(function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    deadline = time.monotonic() + settings.CONFIG.job_database_wait_s
    wait_s = _FIRST_WAIT_S
    while True:
        try:
            return function(*args, **kwargs)
        except DATABASE_ERRORS as exc:
            # Inside a caller's transaction a retry cannot help: the transaction is lost with the connection.
            if connection.in_atomic_block or time.monotonic() + wait_s > deadline:
                raise
            what = getattr(function, "__qualname__", function)
            log.warning("the database is unreachable (%s); %s again in %.1f s", exc, what, wait_s)
            connection.close()
            time.sleep(wait_s)
            wait_s = min(2 * wait_s, _LONGEST_WAIT_S)
