"""OpenAI's list shape: newest first, ``limit`` and ``after=<id>`` with ``has_more``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.db.models import Q, QuerySet
from django.http import QueryDict

from core.api_errors import ApiError, shown
from core.whole_numbers import whole_number

DEFAULT_LIMIT, MAX_LIMIT = 20, 100


def _limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_LIMIT
    limit = whole_number(raw, 1, MAX_LIMIT)
    if limit is None:
        raise ApiError(f"limit must be a whole number from 1 to {MAX_LIMIT}, not '{shown(raw)}'", param="limit")
    return limit


def list_page(query_params: QueryDict, queryset: QuerySet[Any], represent: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    limit = _limit(query_params.get("limit"))
    after = query_params.get("after")
    if after:
        anchor = queryset.filter(pk=after).first()
        if anchor is None:
            raise ApiError(f"after: no such id '{shown(after)}' in this list", param="after")
        queryset = queryset.filter(
            Q(created_at__lt=anchor.created_at) | Q(created_at=anchor.created_at, pk__lt=anchor.pk)
        )
    rows = list(queryset.order_by("-created_at", "-pk")[: limit + 1])
    data = [represent(row) for row in rows[:limit]]
    return {
        "object": "list",
        "data": data,
        "has_more": len(rows) > limit,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }
