"""Answering a batch on a worker (the ``batch`` queue): claim it, read its file, answer the lines
that have no result yet, grouped by the model they name and a few at a time, keep each group's
results before they count, then write the output and error files and finish it.

Safe to deliver twice, and to kill at any moment: only the claim's holder writes (``batches.batch_status``
fences each attempt), a line's result is a row written with the counts before the next group starts,
and a task sent again (by the broker, or by the sweeper once the heartbeat stopped) skips the lines
that have a row. A line whose answer came back but whose row was not yet written when the worker died
is asked again: its answer is kept once. Cancelling, and the end of the completion window, are seen
at the next line boundary; the lines answered so far are in the files either way.
"""

from __future__ import annotations

import logging

from celery.exceptions import SoftTimeLimitExceeded
from django.utils import timezone

from answering.batch import Answerer
from batches import batch_status, line_answers, output_files
from batches.batch_status import Claim
from batches.models import BatchStatus
from core.api_errors import ApiError
from core.batch_input import BatchRequest, read_requests
from finetuning.files import open_content
from finetuning.models import File
from workers.db_retry import retrying

log = logging.getLogger(__name__)

LINES_AT_ONCE = 8  # a group's lines in flight together: the engine batches them, live traffic keeps its share


def run_batch(batch_id: str, worker: str) -> str:
    """Answer the batch; returns what happened, for the worker's log."""
    claimed = retrying(batch_status.claim, batch_id, worker)
    if claimed is None:
        return f"nothing claimed for {batch_id} (it runs elsewhere or has finished)"
    try:
        return _answer(claimed)
    except ApiError as exc:  # its input file went away
        retrying(batch_status.fail, batch_id, exc.code or "batch_failed", exc.message)
    except ValueError as exc:  # the file no longer reads as it did when it was checked
        retrying(batch_status.fail, batch_id, "invalid_file", f"The input file changed since it was checked: {exc}")
    except SoftTimeLimitExceeded:
        retrying(batch_status.fail, batch_id, "time_limit_exceeded", "The batch did not finish in time.")
    except Exception:
        log.exception("batch %s failed", batch_id)  # a bug or a broken environment
        message = "The batch failed on the platform's side; create it again, and if it fails again, tell the platform's operators."
        retrying(batch_status.fail, batch_id, "batch_failed", message)
    return "failed"


def requests_of(file_id: str) -> list[BatchRequest]:
    file = File.objects.filter(pk=file_id).first()
    if file is None:
        raise ApiError(f"File {file_id} was deleted after the batch was created.", status=404, code="file_not_found")
    with open_content(file) as stream:
        return list(read_requests(stream))


def _answer(claimed: Claim) -> str:
    batch = claimed.batch
    requests = retrying(requests_of, batch.input_file_id)
    retrying(batch_status.set_total, claimed, len(requests))
    answered = retrying(batch_status.answered_lines, batch.pk)
    pending = [request for request in requests if request.line not in answered]
    access = line_answers.Access(batch.organization)
    with Answerer(batch.organization_id) as answerer:
        for group in line_answers.in_groups(pending):
            for start in range(0, len(group), LINES_AT_ONCE):
                if retrying(batch_status.ending, claimed, timezone.now()) is not None:
                    return _finish(claimed)  # cancelled or expired: at a line boundary
                results = line_answers.answered(answerer, access, group[start : start + LINES_AT_ONCE], batch.pk)
                if retrying(batch_status.record, claimed, results) is None:
                    return "fenced off: another worker holds the batch now"
    if retrying(batch_status.ending, claimed, timezone.now()) is None and not retrying(batch_status.finalize, claimed):
        return "fenced off: another worker holds the batch now"
    return _finish(claimed)


def _finish(claimed: Claim) -> str:
    status = retrying(batch_status.ending, claimed, timezone.now())
    if status is None:
        return "fenced off: another worker holds the batch now"
    output_file_id, error_file_id = retrying(output_files.write_files, claimed.batch)
    if not retrying(batch_status.finish, claimed, status, output_file_id, error_file_id):
        return "fenced off: another worker holds the batch now"
    return str(BatchStatus(status).value)
