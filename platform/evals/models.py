"""Evals, their runs and each run's scored items. Like every tenant's row, reached through
``for_org``: another organization's eval or run answers 404."""

from __future__ import annotations

from functools import partial
from typing import Self

from django.conf import settings
from django.db import models

from accounts.models import Organization
from base.records import OrgQuerySet, new_id


class Eval(models.Model):
    """The graders its runs' answers are scored with, and what an item looks like: OpenAI's custom
    ``item_schema``, or (the platform's shape) a fine-tuning chat file whose examples are the items,
    each ``{"input": <the messages before the last assistant message>, "expected": <its content>}``."""

    id = models.CharField(primary_key=True, max_length=40, default=partial(new_id, "eval"), editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="evals")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    name = models.CharField(max_length=256)
    file_id = models.CharField(max_length=40, blank=True, default="")  # ours: a chat File, the runs' default source
    item_count = models.IntegerField(default=0)  # the default source's items a run scores (at most MAX_ITEMS)
    item_schema = models.JSONField(null=True, blank=True)  # None: the chat file's items (``sources.CHAT_ITEM_SCHEMA``)
    include_sample_schema = models.BooleanField(default=False)
    testing_criteria = models.JSONField()  # as ``evals.criteria`` keeps them: each with its name
    metadata = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = OrgQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]


class RunStatus(models.TextChoices):  # OpenAI's words
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    CANCELED = "canceled"
    FAILED = "failed"


UNFINISHED_RUN_STATUSES = (RunStatus.QUEUED, RunStatus.IN_PROGRESS)


class RunQuerySet(OrgQuerySet):
    def unfinished(self) -> Self:
        return self.filter(status__in=UNFINISHED_RUN_STATUSES)


class EvalRun(models.Model):
    """One model's answers to an eval's examples, scored on a worker (``workers.run_eval``). The
    counters are the worker's running totals, written after each batch of answers."""

    id = models.CharField(primary_key=True, max_length=40, default=partial(new_id, "evalrun"), editable=False)
    eval = models.ForeignKey(Eval, on_delete=models.CASCADE, related_name="runs")
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="eval_runs")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    name = models.CharField(max_length=256)
    model = models.CharField(max_length=300)  # as named: a base model, a fine-tune, @r<N>, :ckpt-step-<N>
    adapters = models.JSONField(null=True, blank=True)  # a mix on ``model``: [{"model", "scale"}]
    file_id = models.CharField(max_length=40, blank=True, default="")  # the items' File; "" for file_content
    # How the items are read and answered: {"type": "completions" | "responses" | "jsonl",
    # "source": {"type": "file_content", "content": [...]} | {"type": "file_id", "id"}, "input_messages": {...}}
    data_source = models.JSONField(default=dict)
    # {"max_completion_tokens", "temperature", "top_p", "seed"}, and "response_format", "tools" when asked
    sampling = models.JSONField()
    metadata = models.JSONField(null=True, blank=True)
    status = models.CharField(max_length=20, choices=RunStatus.choices, default=RunStatus.QUEUED)
    error_code = models.CharField(max_length=64, blank=True, default="")
    error_message = models.TextField(blank=True, default="")
    total_items = models.IntegerField()
    done_items = models.IntegerField(default=0)
    passed_items = models.IntegerField(default=0)  # every grader passed
    failed_items = models.IntegerField(default=0)
    errored_items = models.IntegerField(default=0)  # no answer: the backend refused or failed
    per_criteria = models.JSONField(default=dict)  # {criterion name: {"passed", "failed"}}
    usage = models.JSONField(default=dict)  # {"invocation_count", "prompt_tokens", "completion_tokens", "cached_tokens"}
    score = models.FloatField(null=True, blank=True)  # the mean share of graders passed, over answered items
    worker = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = RunQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]

    @property
    def is_finished(self) -> bool:
        return self.status not in UNFINISHED_RUN_STATUSES


class OutputItem(models.Model):
    """One item of a run: the item, the prompt made of it, the model's answer (or why there is none),
    and each grader's result."""

    id = models.CharField(primary_key=True, max_length=40, default=partial(new_id, "outputitem"), editable=False)
    run = models.ForeignKey(EvalRun, on_delete=models.CASCADE, related_name="output_items")
    index = models.IntegerField()  # the example's place among the scored ones (OpenAI's datasource_item_id)
    item = models.JSONField(default=dict)  # the data source's item, as graders read it (``{{item.*}}``)
    prompt = models.JSONField()  # the messages the model answered (a jsonl run's: none)
    expected = models.TextField(blank=True, default="")  # a chat file's item: its last assistant message
    answer = models.TextField(null=True, blank=True)  # None: no answer (see error_code)
    answered_by = models.CharField(max_length=300, blank=True, default="")  # the answer's "model": a revision, a mix
    finish_reason = models.CharField(max_length=32, blank=True, default="")
    error_code = models.CharField(max_length=64, blank=True, default="")
    error_message = models.TextField(blank=True, default="")
    # [{"name", "type", "score", "passed", "sample"?: what the grader saw or said}], in the eval's
    # criteria order; [] without an answer
    results = models.JSONField()
    # OpenAI's "pass" (every grader passed) and "fail"; ours, "error": no answer (see error_code)
    status = models.CharField(max_length=8)
    usage = models.JSONField(default=dict)  # {"prompt_tokens", "completion_tokens", "cached_tokens"}
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["index"]
        indexes = [models.Index(fields=["run", "status"])]
        constraints = [models.UniqueConstraint(fields=["run", "index"], name="one_output_item_per_example")]
