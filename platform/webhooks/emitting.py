"""Where an event starts: ``emit``, called from the one place each state changes (a job's status,
a model's publish, an eval run's status), inside the transaction that changes it.

The event and its deliveries are rows written in that transaction (an outbox): a change rolled back
leaves no event, and one committed always has its deliveries, whatever happens to the broker. The
messages that send them leave only once it commits (``transaction.on_commit``); one the broker did
not take is sent again by the sweeper (``webhooks.delivery.resend_lost``)."""

from __future__ import annotations

import logging

from django.db import transaction
from django.utils import timezone
from kombu.exceptions import OperationalError

from base.celery import DELIVER_WEBHOOK, send
from webhooks.event_types import EventType
from webhooks.models import WebhookDelivery, WebhookEndpoint, WebhookEvent

log = logging.getLogger(__name__)


def emit(organization_id: int, event_type: EventType, data: dict) -> WebhookEvent | None:
    """Record ``event_type`` about ``data["id"]`` for every enabled endpoint of the organization that
    wants it, and send it once the transaction commits. None (and nothing written) when no endpoint
    wants it."""
    endpoints = [e for e in WebhookEndpoint.objects.filter(organization_id=organization_id) if e.wants(event_type)]
    if not endpoints:
        return None
    event = WebhookEvent.objects.create(organization_id=organization_id, type=event_type.value, data=data)
    now = timezone.now()
    deliveries = WebhookDelivery.objects.bulk_create(
        WebhookDelivery(event=event, endpoint=endpoint, next_attempt_at=now) for endpoint in endpoints
    )
    ids = [delivery.pk for delivery in deliveries]
    transaction.on_commit(lambda: send_deliveries(ids), robust=True)
    return event


def send_deliveries(delivery_ids: list[str], countdown_s: float | None = None) -> None:
    """Hand each delivery to a worker; a broker that is down loses nothing (the sweeper sends again)."""
    for delivery_id in delivery_ids:
        try:
            send(DELIVER_WEBHOOK, delivery_id, countdown_s=countdown_s)
        except OperationalError as exc:
            log.warning("webhook delivery %s not queued (the sweeper sends it again): %s", delivery_id, exc)
