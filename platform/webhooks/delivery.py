"""Sending a delivery (one event to one endpoint), on a worker, never in a web request.

Each attempt is claimed with a conditional update that counts it (``attempts``, the fencing token),
so two copies of one task message (a redelivery, the sweeper's resend) cannot both send it, and a
delivery that got a 2xx is never sent again. A failed attempt (no answer, or not a 2xx; a redirect
is not followed) waits the next of ``RETRY_DELAYS_S``; after the last, the delivery has failed.
Every attempt carries the same ``webhook-id`` (the delivery's id) and body, and is logged.

Delivery is at least once: an attempt whose worker died after the receiver answered and before the
answer was written is sent again once it is ``STUCK_AFTER`` old, with the same ``webhook-id``, by
which the receiver knows it.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from core.webhook_http import DEADLINE_S, Outcome, post
from core.webhook_signing import signed_headers
from webhooks.emitting import send_deliveries
from webhooks.models import DeliveryAttempt, DeliveryStatus, WebhookDelivery
from webhooks.representations import event_body
from webhooks.targets import allow_private

# The waits before the 2nd, 3rd, ... attempt (seconds): exponential backoff, about x5 each time, so a
# receiver down for a deploy gets the event a few seconds later and one down for half an hour still
# gets it; 6 attempts within about 45 minutes. Bounded below an hour: the Redis broker hands a
# delayed message still unacknowledged after an hour (its visibility timeout) to another worker.
RETRY_DELAYS_S = (5, 30, 120, 600, 1800)
MAX_ATTEMPTS = 1 + len(RETRY_DELAYS_S)
# An attempt under way for this long lost its worker: it may be claimed again.
STUCK_AFTER = timedelta(seconds=DEADLINE_S * 6)


def _claimable(now: datetime) -> Q:
    return Q(status=DeliveryStatus.PENDING) & (Q(sending_since__isnull=True) | Q(sending_since__lt=now - STUCK_AFTER))


def deliver(delivery_id: str) -> str:
    """Make the delivery's next attempt if it is due and nobody else makes it; say what happened."""
    now = timezone.now()
    delivery = (
        WebhookDelivery.objects.filter(_claimable(now), pk=delivery_id).select_related("event", "endpoint").first()
    )
    if delivery is None:
        return "nothing to send"  # delivered, failed, deleted, or an attempt under way elsewhere
    if delivery.next_attempt_at > now + timedelta(seconds=1):
        return "not due yet"  # an early copy of the message: the one due sends it
    if not delivery.endpoint.enabled:
        WebhookDelivery.objects.filter(_claimable(now), pk=delivery_id).update(
            status=DeliveryStatus.FAILED, finished_at=now
        )
        return "endpoint disabled"
    number = delivery.attempts + 1
    claimed = WebhookDelivery.objects.filter(_claimable(now), pk=delivery_id, attempts=delivery.attempts)
    if not claimed.update(attempts=number, sending_since=now):
        return "claimed elsewhere"
    outcome = _attempt(delivery)
    _record(delivery, number, outcome)
    return f"attempt {number}: {outcome.status_code or outcome.error}"


def _attempt(delivery: WebhookDelivery) -> Outcome:
    body = json.dumps(event_body(delivery.event), separators=(",", ":")).encode()
    headers = signed_headers(delivery.endpoint.secret, delivery.pk, int(timezone.now().timestamp()), body)
    return post(delivery.endpoint.url, body, headers, allow_private())


def _record(delivery: WebhookDelivery, number: int, outcome: Outcome) -> None:
    """Log the attempt and move the delivery on, only while this attempt still holds it."""
    now = timezone.now()
    retry_in = None if outcome.delivered or number >= MAX_ATTEMPTS else RETRY_DELAYS_S[number - 1]
    with transaction.atomic():
        mine = WebhookDelivery.objects.filter(pk=delivery.pk, attempts=number, status=DeliveryStatus.PENDING)
        if outcome.delivered:
            moved = mine.update(status=DeliveryStatus.SUCCEEDED, sending_since=None, finished_at=now)
        elif retry_in is None:
            moved = mine.update(status=DeliveryStatus.FAILED, sending_since=None, finished_at=now)
        else:
            moved = mine.update(sending_since=None, next_attempt_at=now + timedelta(seconds=retry_in))
        if not moved:
            return  # given up on as stuck and claimed again: that attempt records itself
        DeliveryAttempt.objects.create(
            delivery=delivery, number=number, status_code=outcome.status_code, error=outcome.error[:300],
            duration_ms=outcome.duration_ms,
        )
        if retry_in is not None:
            transaction.on_commit(lambda: send_deliveries([delivery.pk], countdown_s=retry_in), robust=True)


def resend_lost(lost_after: timedelta) -> list[str]:
    """Deliveries whose message the broker lost (or never took): due for longer than ``lost_after``
    with no attempt under way, or stuck in one. Sent again, each marked so the next pass waits."""
    now = timezone.now()
    overdue = WebhookDelivery.objects.filter(_claimable(now), next_attempt_at__lt=now - lost_after)
    resent = []
    for delivery_id, due in overdue.values_list("pk", "next_attempt_at")[:1000]:
        if WebhookDelivery.objects.filter(pk=delivery_id, next_attempt_at=due).update(next_attempt_at=now):
            resent.append(delivery_id)
    send_deliveries(resent)
    return resent
