"""An organization's usage in the shape of OpenAI's usage API: consecutive time buckets of one
width (a minute, an hour or a day, on UTC boundaries), each with one result per group.

Two kinds of usage, each a ``Source``: completions, as the gateway counted them
(``usage.models.CompletionUsage``), and trained tokens, read from the succeeded jobs themselves
(counted on the day a job finished). Buckets are summed by the database, so a page costs one query
whatever the traffic behind it.
"""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, overload

from django.db.models import Aggregate, Count, QuerySet, Sum
from django.db.models.functions import Trunc
from django.http import QueryDict

from accounts.models import Organization
from core.api_errors import ApiError, shown
from core.whole_numbers import whole_number
from finetuning.models import FineTuningJob, JobStatus
from usage.models import CompletionUsage


@dataclass(frozen=True)
class Width:
    seconds: int
    trunc_kind: str  # Django's name for the unit a bucket's start is truncated to
    default_limit: int  # buckets a page holds, as OpenAI's defaults and maxima
    max_limit: int


WIDTHS = {
    "1m": Width(60, "minute", 60, 1440),
    "1h": Width(3600, "hour", 24, 168),
    "1d": Width(86400, "day", 7, 31),
}


@dataclass(frozen=True)
class Source:
    result_object: str
    rows: Callable[[Organization], QuerySet]
    time_field: str
    groups: dict[str, str]  # a ``group_by`` value -> the row field it groups by; the filter is its plural
    sums: dict[str, Aggregate]  # a result field -> how a bucket's rows add up to it
    unfiltered: frozenset[str] = frozenset()  # groups with no plural filter (a yes/no: group by it instead)


COMPLETIONS = Source(
    result_object="organization.usage.completions.result",
    rows=lambda organization: CompletionUsage.objects.filter(organization=organization),
    time_field="minute",
    groups={"model": "model", "api_key_id": "api_key__prefix", "batch": "batch"},  # a key as its dashboard shows it
    unfiltered=frozenset({"batch"}),
    sums={
        "input_tokens": Sum("prompt_tokens"),
        "output_tokens": Sum("completion_tokens"),
        "input_cached_tokens": Sum("cached_tokens"),
        "num_model_requests": Sum("requests"),
    },
)
FINE_TUNING = Source(
    result_object="organization.usage.fine_tuning.result",
    rows=lambda organization: FineTuningJob.objects.filter(organization=organization, status=JobStatus.SUCCEEDED),
    time_field="finished_at",
    groups={"model": "fine_tuned_model"},
    sums={"trained_tokens": Sum("trained_tokens"), "num_jobs": Count("pk")},
)


@dataclass(frozen=True)
class UsageQuery:
    start: int  # the first bucket's start, Unix seconds, on a boundary of ``width``
    end: int  # exclusive
    width: str
    limit: int  # buckets a page holds
    group_by: tuple[str, ...] = ()
    filters: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # a group -> the values kept

    @property
    def bucket_seconds(self) -> int:
        return WIDTHS[self.width].seconds


LAST_SECOND = 253402300799  # 9999-12-31T23:59:59Z, the last second a datetime holds


@overload
def _whole_number(params: Mapping[str, Any], name: str, default: int, unit: str = ...) -> int: ...
@overload
def _whole_number(params: Mapping[str, Any], name: str, default: None = None, unit: str = ...) -> int | None: ...
def _whole_number(params: Mapping[str, Any], name: str, default: int | None = None, unit: str = "Unix seconds") -> int | None:
    raw = params.get(name)
    if raw is None or raw == "":
        return default
    value = whole_number(raw, 0, LAST_SECOND)
    if value is None:
        raise ApiError(f"{name} must be a whole number of {unit} up to {LAST_SECOND}, not '{shown(raw)}'.", param=name)
    return value


def _list(params: QueryDict, name: str) -> list[str]:
    """``name=a&name=b``, ``name=a,b`` and ``name[]=a`` all give ``[a, b]``."""
    values = [*params.getlist(name), *params.getlist(f"{name}[]")]
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def parse_query(params: QueryDict, source: Source, now: float | None = None) -> UsageQuery:
    """The query string of a usage request (a Django ``QueryDict``); a 400 that names what to fix."""
    start = _whole_number(params, "start_time")
    if start is None:
        raise ApiError("start_time is required: the start of the first bucket, in Unix seconds.", param="start_time")
    width = params.get("bucket_width") or "1d"
    if width not in WIDTHS:
        raise ApiError(f"bucket_width must be one of {', '.join(WIDTHS)}, not '{shown(width)}'.", param="bucket_width")
    end = _whole_number(params, "end_time", default=math.ceil(now if now is not None else time.time()))
    if end <= start:
        raise ApiError(f"end_time ({end}) must be after start_time ({start}).", param="end_time")
    limits = WIDTHS[width]
    limit = _whole_number(params, "limit", default=limits.default_limit, unit="buckets")
    if not 1 <= limit <= limits.max_limit:
        raise ApiError(f"limit must be from 1 to {limits.max_limit} buckets of {width}, not {limit}.", param="limit")
    group_by = tuple(dict.fromkeys(_list(params, "group_by")))
    for group in group_by:
        if group not in source.groups:
            known = " or ".join(source.groups)
            raise ApiError(f"group_by: this usage groups by {known}, not '{shown(group)}'.", param="group_by")
    filters = {
        group: tuple(_list(params, f"{group}s"))
        for group in source.groups
        if group not in source.unfiltered and _list(params, f"{group}s")
    }
    first = start - start % limits.seconds
    page = _whole_number(params, "page")
    if page is not None and (page < first or page >= end or (page - first) % limits.seconds):
        raise ApiError(f"page: '{page}' is not a bucket of this query; pass a response's next_page.", param="page")
    return UsageQuery(page if page is not None else first, end, width, limit, group_by, filters)


def usage_page(organization: Organization, source: Source, query: UsageQuery) -> dict[str, Any]:
    """One page of buckets, from ``query.start``: OpenAI's ``{"object": "page", "data", "has_more", "next_page"}``."""
    step = query.bucket_seconds
    count = min(query.limit, math.ceil((query.end - query.start) / step))
    page_end = min(query.start + count * step, query.end)
    by_bucket: dict[int, list[dict[str, Any]]] = {query.start + index * step: [] for index in range(count)}
    for row in _summed(organization, source, query, page_end):
        result: dict[str, Any] = {"object": source.result_object}
        result |= {name: int(row[f"total_{name}"] or 0) for name in source.sums}
        result |= {group: row.get(source.groups[group]) for group in source.groups}
        by_bucket[int(row["bucket"].timestamp())].append(result)
    following = query.start + count * step
    return {
        "object": "page",
        "data": [
            {"object": "bucket", "start_time": start, "end_time": start + step, "results": results}
            for start, results in by_bucket.items()
        ],
        "has_more": following < query.end,
        "next_page": str(following) if following < query.end else None,
    }


def _summed(organization: Organization, source: Source, query: UsageQuery, page_end: int) -> QuerySet:
    fields = [source.groups[group] for group in query.group_by]
    rows = source.rows(organization).filter(
        **{
            f"{source.time_field}__gte": _utc(query.start),
            f"{source.time_field}__lt": _utc(page_end),
            **{f"{source.groups[group]}__in": values for group, values in query.filters.items()},
        }
    )
    bucket = Trunc(source.time_field, WIDTHS[query.width].trunc_kind, tzinfo=timezone.utc)
    totals = {f"total_{name}": aggregate for name, aggregate in source.sums.items()}  # not a field's name
    return rows.annotate(bucket=bucket).values("bucket", *fields).annotate(**totals).order_by("bucket", *fields)


def _utc(seconds: int) -> datetime:
    return datetime.fromtimestamp(seconds, timezone.utc)


SUMMED = (*COMPLETIONS.sums, *FINE_TUNING.sums)


@dataclass(frozen=True)
class ModelTotals:
    model: str
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    trained_tokens: int = 0


@dataclass(frozen=True)
class DailyUsage:
    """The last ``days`` days (today included) by model: the dashboard's usage page."""

    completions: list[dict[str, Any]]  # buckets, as the API gives them
    totals: list[ModelTotals]  # most tokens first


def daily_usage(organization: Organization, days: int, now: float | None = None) -> DailyUsage:
    end = math.ceil(now if now is not None else time.time())
    day = WIDTHS["1d"].seconds
    query = UsageQuery(end - end % day - (days - 1) * day, end, "1d", days, group_by=("model",))
    completions = usage_page(organization, COMPLETIONS, query)["data"]
    trained = usage_page(organization, FINE_TUNING, query)["data"]
    totals: defaultdict[str, Counter[str]] = defaultdict(Counter)  # a model's sums, 0 for what it has none of
    for bucket in completions + trained:
        for result in bucket["results"]:
            totals[result["model"]].update({name: result[name] for name in SUMMED if name in result})
    rows = [
        ModelTotals(model, sums["num_model_requests"], sums["input_tokens"], sums["output_tokens"], sums["trained_tokens"])
        for model, sums in totals.items()
    ]
    rows.sort(key=lambda row: (-(row.input_tokens + row.output_tokens + row.trained_tokens), row.model))
    return DailyUsage(completions, rows)
