"""Building a composed model on a worker: claim it, merge, check, publish, record the outcome.

Safe to run twice for one composition (a redelivered task): only the worker whose conditional
update moves it from "queued" to "running" builds it; the others return at once. Publishing is
``finetuning.publishing``'s (``publish_composition``, through ``finetuning.compose``), the steps
uploads take too: the model is registered, then its adapter is published, and a failure there
unregisters it, so a failed composition leaves nothing behind.
"""

from __future__ import annotations

import errno
import logging

from celery.exceptions import SoftTimeLimitExceeded

from base.database_outage import DATABASE_ERRORS
from core.api_errors import ApiError
from finetuning import compose, compositions
from workers.db_retry import retrying

log = logging.getLogger(__name__)


def run_composition(composition_id: str, worker: str) -> str:
    """Build and publish the composition; returns what happened, for the worker's log."""
    composition = retrying(compositions.claim, composition_id, worker)
    if composition is None:
        return f"nothing claimed for {composition_id} (it runs elsewhere or has finished)"
    try:
        model = compose.build_composition(
            composition.organization, compositions.plan_of(composition), held_by=composition.pk
        )
    except Exception as exc:
        code, message = _explained(exc, composition_id)
        retrying(compositions.fail, composition_id, code, message)
        return "failed"
    if not retrying(compositions.succeed, composition_id, model):
        log.warning("composition %s published %s after it was given up on", composition_id, model.name)
    return "succeeded"


def _explained(exc: Exception, composition_id: str) -> tuple[str, str]:
    """(code, message) of a failure, said so a person knows what to change; no internal detail."""
    nothing = "Nothing was published, and the suffix is free again."
    if isinstance(exc, ApiError):  # a parent deleted meanwhile, the quota taken meanwhile, a store down, ...
        return exc.code or "composition_failed", f"{exc.message} {nothing}"
    if isinstance(exc, SoftTimeLimitExceeded):  # raised by Celery wherever the task was (workers.tasks)
        return (
            "time_limit_exceeded",
            f"The composition did not finish in time. {nothing} Try fewer parents or a lower rank.",
        )
    if isinstance(exc, DATABASE_ERRORS):
        log.exception("composition %s: the database stayed unreachable", composition_id)
        return (
            "database_unavailable",
            f"The database was unreachable while the model was composed. {nothing} Compose it again.",
        )
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return "storage_full", f"The platform ran out of disk space while composing. {nothing} Compose it again later."
    log.exception("composition %s failed", composition_id)  # a bug or a broken environment
    return (
        "composition_failed",
        f"The composition failed on the platform's side. {nothing} Compose it again; if it fails again, tell the platform's operators.",
    )
