"""The gateway's own Prometheus metrics; /metrics adds the backends' (per model, adapters, replicas)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
REGISTRY = CollectorRegistry()

# No model label: rejected requests name arbitrary models; the pool counts per model.
REQUESTS = Counter(
    "fineserve_gateway_requests", "Requests to the inference endpoints (API and dashboard playground) by endpoint and status",
    ["endpoint", "status"], registry=REGISTRY,
)


def render() -> bytes:
    return generate_latest(REGISTRY)


def joined(*texts: bytes) -> bytes:
    """Prometheus texts as one. The embedded pool and Ray Serve show the same families, each for its
    own models: a family several texts have is declared once (a scraper may refuse a second HELP or
    TYPE for a name), with all their samples. Lines before a text's first family (a comment saying a
    backend is unavailable) come first."""
    families: dict[bytes, list[bytes]] = {b"": []}  # by name; b"": the lines outside any family
    for text in texts:
        lines, declared = families[b""], False
        for line in text.splitlines():
            if line.startswith(b"# HELP "):
                name = line.split(b" ", 3)[2]
                declared = name in families
                lines = families.setdefault(name, [])
            if not (declared and line.startswith((b"# HELP ", b"# TYPE "))):
                lines.append(line)
    return b"".join(line + b"\n" for lines in families.values() for line in lines)
