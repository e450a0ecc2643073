"""One organization's changes that must not interleave (its storage quota, its running jobs)."""

from __future__ import annotations

from django.db.models import F

from accounts.models import Organization


def lock_organization(organization_id: int) -> None:
    """Inside a transaction: until it ends, another transaction that locks the same organization
    waits here, so a count read after this sees what the previous holder committed.

    A no-op UPDATE rather than SELECT ... FOR UPDATE: on PostgreSQL both hold the row's lock, but
    SQLite has no row locks, and there only a write takes the database's write lock at once; a read
    first would let two transactions count the same rows and then fail to write."""
    Organization.objects.filter(pk=organization_id).update(slug=F("slug"))
