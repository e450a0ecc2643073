"""What an organization may upload: files per hour (a rate, in Redis) and bytes kept (a quota, in
the database). Uploaded adapters (``finetuning.adapters``) count against both, as datasets do.

The hourly rate counts every upload that gets as far as being read and validated, accepted or not:
it protects the platform's time as much as its disk. Like the completion rates it is not enforced
while Redis is down (``core.rate_limits``). The storage quota is the sum of the sizes of the
organization's files and uploaded adapters, checked before the file is stored and again under the
organization's lock in the transaction that adds its row, so two uploads at once cannot both take
the last of it (the loser's bytes are deleted again); it is refused with 403, not 429, because waiting does not help: only
deleting files does. A composition built on a worker is measured at its most before it is queued,
and that much stays reserved for it (``reserved_bytes``) until it has finished.
"""

from __future__ import annotations

from django.conf import settings
from django.db.models import Sum

from accounts.locks import lock_organization
from accounts.models import Organization
from core.api_errors import ApiError, human_size
from core.config import LIMIT_SETTINGS
from core.rate_limits import Limit, charge
from finetuning.models import Composition, File, FineTunedModel

HOUR_S = 3600


def charge_hourly(organization: Organization, noun: str, setting: str, param: str) -> None:
    """Count one more of ``noun`` against the organization's hourly rate (the limit named
    ``setting``); the 429 naming ``param`` when it is used up."""
    per_hour = getattr(settings.CONFIG.limits, setting)
    limit = Limit(
        f"{noun}:org:{organization.pk}", per_hour, HOUR_S, f"{per_hour} {noun} per hour for this organization",
        LIMIT_SETTINGS[setting],
    )
    exceeded = charge(settings.CONFIG.redis_url, [limit])
    if exceeded is not None:
        raise exceeded.error(param=param)


def charge_upload(organization: Organization) -> None:
    """Count one upload (a dataset or an adapter) against the organization's hourly rate."""
    charge_hourly(organization, "uploads", "uploads_per_hour_per_organization", param="file")


def check_storage(
    organization: Organization, size: int, locked: bool = False, what: str = "this file", param: str = "file",
    reserved: int = 0,
) -> None:
    """The 403 when a file of ``size`` bytes would take the organization's files past its quota.
    ``locked``: inside the transaction that adds the file, under the organization's lock until it
    ends, so two uploads at once cannot both take the last of the quota. ``what`` and ``param``
    name what is stored in the message (a file, an adapter, a composed model); ``reserved`` is what
    work under way may still store (``reserved_bytes``), counted as if it were stored already."""
    if locked:
        lock_organization(organization.pk)
    quota = settings.CONFIG.limits.storage_bytes_per_organization
    kept = stored_bytes(organization)
    if kept + reserved + size > quota:
        setting = LIMIT_SETTINGS["storage_bytes_per_organization"]
        under_way = f", and compositions under way up to {human_size(reserved)}" if reserved else ""
        raise ApiError(
            f"Storing {what} ({human_size(size)}) would take {organization.name} past its storage quota of "
            f"{human_size(quota)} ({setting}); its files and uploaded adapters take {human_size(kept)}{under_way}. Delete "
            "what it no longer needs, or ask the platform's operators to raise the quota.",
            status=403, param=param, code="storage_quota_exceeded",
        )


def stored_bytes(organization: Organization) -> int:
    """What the organization keeps: its files, and the adapters it uploaded (trained ones are the
    platform's work, and do not count)."""
    files = File.objects.for_org(organization).aggregate(total=Sum("bytes"))["total"] or 0
    adapters = FineTunedModel.objects.for_org(organization).aggregate(total=Sum("uploaded_bytes"))["total"] or 0
    return files + adapters


def reserved_bytes(organization: Organization) -> int:
    """What the organization's compositions under way (queued or running) may still store: each
    at its most, as it was measured against the quota when it was queued."""
    under_way = Composition.objects.for_org(organization).unfinished()
    return under_way.aggregate(total=Sum("estimated_bytes"))["total"] or 0
