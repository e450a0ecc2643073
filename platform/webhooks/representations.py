"""The webhooks API's objects, and the body every delivery of an event carries (OpenAI's webhook
event shape: ``{"id": "evt_...", "object": "event", "type", "created_at", "data": {"id"}}``)."""

from __future__ import annotations

from base.records import unix
from webhooks.models import WebhookDelivery, WebhookEndpoint, WebhookEvent


def event_body(event: WebhookEvent) -> dict:
    return {
        "id": event.id,
        "object": "event",
        "type": event.type,
        "created_at": unix(event.created_at),
        "data": event.data,
    }


def endpoint_object(endpoint: WebhookEndpoint, secret: str | None = None) -> dict:
    """``secret`` only in the answer to its creation: it is never shown again."""
    shown = {
        "object": "webhook_endpoint",
        "id": endpoint.id,
        "url": endpoint.url,
        "description": endpoint.description,
        "event_types": endpoint.event_types,
        "enabled": endpoint.enabled,
        "created_at": unix(endpoint.created_at),
    }
    return shown | ({"secret": secret} if secret is not None else {})


def delivery_object(delivery: WebhookDelivery) -> dict:
    return {
        "object": "webhook_delivery",
        "id": delivery.id,  # the webhook-id header of each attempt
        "event": event_body(delivery.event),
        "status": delivery.status,
        "attempts": [
            {
                "attempt": attempt.number,
                "status_code": attempt.status_code,
                "error": attempt.error or None,
                "duration_ms": attempt.duration_ms,
                "created_at": unix(attempt.created_at),
            }
            for attempt in delivery.attempt_log.all()
        ],
        "next_attempt_at": unix(delivery.next_attempt_at) if delivery.status == "pending" else None,
        "created_at": unix(delivery.created_at),
        "finished_at": unix(delivery.finished_at),
    }
