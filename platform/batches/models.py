"""Batches (OpenAI's Batch API) and the result of each of their lines. Like every tenant's row,
reached through ``for_org``: another organization's batch answers 404."""

from __future__ import annotations

from functools import partial

from django.conf import settings
from django.db import models

from accounts.models import Organization
from base.records import OrgQuerySet, new_id


class BatchStatus(models.TextChoices):  # OpenAI's words
    VALIDATING = "validating"  # checked and waiting for a worker (the file was checked before the row was written)
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"  # every line answered: the output and error files are being written
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"  # not finished within its completion window; the lines answered are kept
    CANCELLING = "cancelling"  # the worker stops at its next line boundary
    CANCELLED = "cancelled"


UNFINISHED_BATCH_STATUSES = (
    BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING, BatchStatus.CANCELLING,
)
# Where a worker answers lines or writes files: a re-delivered task goes on from these.
WORKING_STATUSES = (BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING, BatchStatus.CANCELLING)


class Batch(models.Model):
    """A file of requests answered on a worker (``workers.run_batch``), at a lower priority than
    live traffic; the counts are recomputed from the result rows each time some are written."""

    id = models.CharField(primary_key=True, max_length=40, default=partial(new_id, "batch", "_"), editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="batches")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    input_file_id = models.CharField(max_length=40)  # an id, not a key: the batch keeps naming a deleted file
    endpoint = models.CharField(max_length=64)
    completion_window = models.CharField(max_length=8)
    metadata = models.JSONField(null=True, blank=True)
    status = models.CharField(max_length=20, choices=BatchStatus.choices, default=BatchStatus.VALIDATING)
    errors = models.JSONField(null=True, blank=True)  # a failed batch's: [{"code", "message", "param", "line"}]
    output_file_id = models.CharField(max_length=40, null=True, blank=True)
    error_file_id = models.CharField(max_length=40, null=True, blank=True)
    total = models.IntegerField(default=0)  # the requests of the input file
    completed = models.IntegerField(default=0)  # answered 200
    failed = models.IntegerField(default=0)  # refused, by the platform or the model's backend
    usage = models.JSONField(default=dict)  # {"input_tokens", "output_tokens", "cached_tokens"}
    # Fencing, as jobs have: each claim is an attempt of its own, and a worker writes only under its
    # own attempt (one that the sweeper gave up on and sent again writes nothing more).
    attempt = models.IntegerField(default=0)
    worker = models.CharField(max_length=200, blank=True, default="")
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    objects = OrgQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["status", "heartbeat_at"], name="batch_by_status_heartbeat")]

    @property
    def is_finished(self) -> bool:
        return self.status not in UNFINISHED_BATCH_STATUSES


class BatchResult(models.Model):
    """One line's outcome, written before it counts: its output-file line (``ok``) or error-file line,
    as JSON text. A line has at most one (the constraints), so a task sent again skips lines that
    have one and never writes a line twice."""

    id = models.CharField(primary_key=True, max_length=40, default=partial(new_id, "batch_req", "_"), editable=False)
    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="results")
    line = models.IntegerField()  # the input file's line number
    custom_id = models.CharField(max_length=512)
    ok = models.BooleanField()  # answered 200: the output file's; otherwise the error file's
    record = models.TextField()  # the whole file line, JSON, without its newline
    input_tokens = models.IntegerField(default=0)
    output_tokens = models.IntegerField(default=0)
    cached_tokens = models.IntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["line"]
        constraints = [
            models.UniqueConstraint(fields=["batch", "line"], name="one_result_per_batch_line"),
        ]
