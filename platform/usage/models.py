"""Completions served, as the gateway counted them (``usage.meter``). Trained tokens are not kept
here: a succeeded job's ``trained_tokens`` is their one record (``usage.report`` reads both)."""

from __future__ import annotations

from django.db import models

from accounts.models import ApiKey, Organization


class CompletionUsage(models.Model):
    """One organization's completions of one model, with one API key, in one minute.

    Rows are added to, never rewritten: a flush adds its counts to the row of its minute, or makes
    one. Two processes flushing the same minute at once may make two rows; every reader sums them.
    """

    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="completion_usage")
    minute = models.DateTimeField()  # the minute's start, UTC
    model = models.CharField(max_length=300)  # the name the request asked for (a mix: its base model)
    # The key that asked; None for the dashboard's playground. A revoked key keeps its usage.
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    batch = models.BooleanField(default=False)  # a Batch API line's answers (OpenAI's ``batch`` group)
    requests = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    cached_tokens = models.BigIntegerField(default=0)  # of prompt_tokens, read from the prefix cache

    class Meta:
        indexes = [models.Index(fields=["organization", "minute"], name="usage_by_org_and_minute")]
