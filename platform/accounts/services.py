"""Account operations shared by the API, the dashboard and management commands."""

from __future__ import annotations

import secrets
from datetime import timedelta

from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import F
from django.utils import timezone
from django.utils.text import slugify

from accounts.models import ApiKey, ApiKeyQuerySet, Membership, Organization, hash_key
from accounts.signals import access_withdrawn

KEY_PREFIX = "sk-"
SHOWN_CHARS = 10  # of a key, its public prefix: "sk-" and 7 random characters
# Writing last_used_at on every request would turn every read into a write; a minute is precise enough.
_LAST_USED_RESOLUTION = timedelta(minutes=1)


@transaction.atomic
def create_organization(name: str, owner: User) -> Organization:
    base = slugify(name) or "org"
    slug, n = base, 1
    while Organization.objects.filter(slug=slug).exists():
        n += 1
        slug = f"{base}-{n}"
    organization = Organization.objects.create(name=name, slug=slug)
    Membership.objects.create(user=owner, organization=organization, role=Membership.Role.OWNER)
    return organization


def create_api_key(organization: Organization, user: User, name: str) -> tuple[ApiKey, str]:
    """Return the key and its secret; the secret is shown once and only its hash is kept."""
    raw_key = _new_secret()
    # The prefix names the key on the dashboard (its revoke URL), so it is unique within the
    # organization: 42 random bits make a clash all but impossible, and a clash draws again.
    while ApiKey.objects.filter(organization=organization, prefix=raw_key[:SHOWN_CHARS]).exists():
        raw_key = _new_secret()
    api_key = ApiKey.objects.create(
        organization=organization, created_by=user, name=name, prefix=raw_key[:SHOWN_CHARS], hashed_key=hash_key(raw_key)
    )
    return api_key, raw_key


def _new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def revoke_api_key(api_key: ApiKey) -> None:
    ApiKey.objects.filter(pk=api_key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
    access_withdrawn.send(sender=ApiKey)  # update() sends no model signal


def _usable_keys() -> ApiKeyQuerySet:
    """Keys that may act: not revoked, made by an active user who still belongs to the key's
    organization (a key acts for its organization on its maker's behalf, so it goes with them)."""
    return ApiKey.objects.active().filter(
        created_by__is_active=True, created_by__memberships__organization=F("organization")
    )


def authenticate_key(raw_key: str) -> ApiKey | None:
    if not raw_key.startswith(KEY_PREFIX):
        return None
    api_key = (
        _usable_keys().select_related("organization", "created_by").filter(hashed_key=hash_key(raw_key)).first()
    )
    if api_key is None:
        return None
    now = timezone.now()
    if api_key.last_used_at is None or now - api_key.last_used_at > _LAST_USED_RESOLUTION:
        ApiKey.objects.filter(pk=api_key.pk).update(last_used_at=now)
    return api_key
