"""An organization's webhook endpoints, the events that happened to it, and each event's delivery
to each endpoint with every attempt. Reached through ``for_org``: another organization's endpoint
answers 404."""

from __future__ import annotations

from functools import partial

from django.conf import settings
from django.db import models

from accounts.models import Organization
from base.records import OrgQuerySet, new_id


class WebhookEndpoint(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=partial(new_id, "webhook"), editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="webhook_endpoints")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    url = models.CharField(max_length=2048)  # checked at registration (webhooks.targets), and again at each send
    description = models.CharField(max_length=256, blank=True, default="")
    event_types = models.JSONField(default=list)  # EventType values; empty: every event
    enabled = models.BooleanField(default=True)
    # Standard Webhooks' whsec_...: shown once, at creation; kept to sign with (core.webhook_signing).
    secret = models.CharField(max_length=100)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = OrgQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]

    def wants(self, event_type: str) -> bool:
        return self.enabled and (not self.event_types or event_type in self.event_types)


class WebhookEvent(models.Model):
    """What happened, as every endpoint receives it: ``{"id", "object": "event", "type", "created_at",
    "data"}`` (``webhooks.representations.event_body``)."""

    id = models.CharField(primary_key=True, max_length=40, default=partial(new_id, "evt", "_"), editable=False)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="webhook_events")
    type = models.CharField(max_length=64)
    data = models.JSONField()  # {"id": the object's id, ...}
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]


class DeliveryStatus(models.TextChoices):
    PENDING = "pending"  # its next attempt waits (next_attempt_at), or is being sent (sending_since)
    SUCCEEDED = "succeeded"  # a 2xx: never sent again
    FAILED = "failed"  # every attempt failed, or its endpoint was disabled before it was sent


class WebhookDelivery(models.Model):
    """One event to one endpoint: its id is the ``webhook-id`` every attempt carries."""

    id = models.CharField(primary_key=True, max_length=40, default=partial(new_id, "msg", "_"), editable=False)
    event = models.ForeignKey(WebhookEvent, on_delete=models.CASCADE, related_name="deliveries")
    endpoint = models.ForeignKey(WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries")
    status = models.CharField(max_length=16, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING)
    attempts = models.IntegerField(default=0)  # claimed so far: the fencing token of the attempt under way
    next_attempt_at = models.DateTimeField()
    sending_since = models.DateTimeField(null=True, blank=True)  # set while an attempt is under way
    finished_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["status", "next_attempt_at"])]
        constraints = [
            models.UniqueConstraint(fields=["event", "endpoint"], name="one_delivery_per_event_and_endpoint")
        ]


class DeliveryAttempt(models.Model):
    """One POST of a delivery, as its endpoint's delivery log shows it."""

    delivery = models.ForeignKey(WebhookDelivery, on_delete=models.CASCADE, related_name="attempt_log")
    number = models.IntegerField()  # 1 for the first
    status_code = models.IntegerField(null=True, blank=True)  # None: no answer (see error)
    error = models.CharField(max_length=300, blank=True, default="")
    duration_ms = models.IntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["number"]
        constraints = [models.UniqueConstraint(fields=["delivery", "number"], name="one_attempt_per_number")]
