"""Who may read the platform's operational detail: ``/metrics`` and the checks of ``/healthz``.

Metrics name every organization's fine-tuned models with their request counts, and the health
checks name inner addresses and worker hosts; a load balancer needs only "up" or "down". The
detail is for the operator's scraper, which presents MONITORING_TOKEN (the internal token unless
set: ``core.config``).
"""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest

from core.internal_token import presents


def from_monitoring(request: HttpRequest) -> bool:
    return presents(request.headers.get("Authorization"), settings.MONITORING_TOKEN)
