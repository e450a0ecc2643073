"""Registering, changing and removing an organization's webhook endpoints: the functions the API and
the dashboard both call."""

from __future__ import annotations

from django.contrib.auth.models import User
from django.db import transaction

from accounts.models import Organization
from core.api_errors import ApiError
from core.webhook_signing import new_secret
from webhooks.models import WebhookEndpoint
from webhooks.targets import checked_url

# Each event is sent to each endpoint that wants it: this bounds one event's fan-out.
MAX_ENDPOINTS_PER_ORGANIZATION = 20


def register(
    organization: Organization, user: User | None, url: str, event_types: list[str] | None = None,
    description: str = "", enabled: bool = True,
) -> tuple[WebhookEndpoint, str]:
    """A new endpoint, and its signing secret (to show once: it is not shown again)."""
    url = checked_url(url)
    with transaction.atomic():
        Organization.objects.select_for_update().filter(pk=organization.pk).first()  # counted under the lock
        if WebhookEndpoint.objects.for_org(organization).count() >= MAX_ENDPOINTS_PER_ORGANIZATION:
            raise ApiError(
                f"An organization may have at most {MAX_ENDPOINTS_PER_ORGANIZATION} webhook endpoints; delete one first.",
                param="url", code="too_many_endpoints",
            )
        secret = new_secret()
        endpoint = WebhookEndpoint.objects.create(
            organization=organization, created_by=user, url=url, event_types=event_types or [],
            description=description, enabled=enabled, secret=secret,
        )
    return endpoint, secret


def update(endpoint: WebhookEndpoint, changes: dict) -> WebhookEndpoint:
    """``changes``: any of url, description, event_types (empty: all), enabled. An endpoint disabled
    receives nothing from then on; what was waiting to be retried is not sent."""
    if not changes:
        raise ApiError(
            "Nothing to update: give url, description, event_types or enabled.", param="url", code="invalid_body"
        )
    if "url" in changes:
        changes["url"] = checked_url(changes["url"])
    if "event_types" in changes:
        changes["event_types"] = changes["event_types"] or []
    for field, value in changes.items():
        setattr(endpoint, field, value)
    endpoint.save(update_fields=[*changes, "updated_at"])
    return endpoint


def set_enabled(endpoint: WebhookEndpoint, enabled: bool) -> WebhookEndpoint:
    return update(endpoint, {"enabled": enabled})


def remove(endpoint: WebhookEndpoint) -> None:
    """The endpoint goes with its delivery log; what was waiting to be retried is not sent."""
    endpoint.delete()
