"""The gateway's own Prometheus metrics; /metrics adds the pool's (per model, adapters, replicas)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
REGISTRY = CollectorRegistry()

# No model label: rejected requests name arbitrary models; the pool counts per model.
REQUESTS = Counter(
    "fineserve_gateway_requests", "Requests to the inference endpoints (API and dashboard playground) by endpoint and status",
    ["endpoint", "status"], registry=REGISTRY,
)  # fmt: skip


def render() -> bytes:
    return generate_latest(REGISTRY)
