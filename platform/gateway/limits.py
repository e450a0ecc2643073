"""Completions per minute, per API key and per organization (``core.rate_limits`` counts them).

Checked after the key is known and before the pool is called, for every authenticated request (a
refused model costs the gateway too). The playground signs in without a key: only its
organization's limit applies there, the same counter its keys share.
"""

from __future__ import annotations

from django.conf import settings

from core.config import LIMIT_SETTINGS
from core.rate_limits import Limit, charge_async

MINUTE_S = 60


def completion_limits(organization_id: int, api_key_id: int | None) -> list[Limit]:
    limits = settings.CONFIG.limits
    per_organization = Limit(
        f"completions:org:{organization_id}", limits.completions_per_minute_per_organization, MINUTE_S,
        f"{limits.completions_per_minute_per_organization} completions per minute for this organization",
        LIMIT_SETTINGS["completions_per_minute_per_organization"],
    )  # fmt: skip
    if api_key_id is None:
        return [per_organization]
    per_key = Limit(
        f"completions:key:{api_key_id}", limits.completions_per_minute_per_key, MINUTE_S,
        f"{limits.completions_per_minute_per_key} completions per minute for this API key",
        LIMIT_SETTINGS["completions_per_minute_per_key"],
    )  # fmt: skip
    return [per_key, per_organization]


async def check_completion_rate(organization_id: int, api_key_id: int | None = None) -> None:
    """Raise the 429 (with Retry-After) when the key or its organization is over its rate."""
    exceeded = await charge_async(settings.CONFIG.redis_url, completion_limits(organization_id, api_key_id))
    if exceeded is not None:
        raise exceeded.error()
