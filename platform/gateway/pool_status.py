"""What the inference pool says about itself (``GET /health``): for /healthz and the models page."""

from __future__ import annotations

from collections import Counter

import httpx

from gateway.pool_client import pool_headers, pool_url

TIMEOUT_S = 1.0


class PoolUnavailable(Exception):
    """The pool did not answer, or not with its health document; the message says which."""


def pool_health() -> tuple[int, dict]:
    """The status code and body of the pool's health document."""
    url = pool_url("/health")
    try:
        response = httpx.get(url, headers=pool_headers(), timeout=TIMEOUT_S)
        return response.status_code, response.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise PoolUnavailable(f"{url}: {exc}") from None


def replicas_serving() -> Counter[str]:
    """How many healthy replicas hold each model now: a base model on every replica of its own, a
    fine-tuned one where its adapter is loaded (it loads on its first request, in well under 2 s)."""
    _, body = pool_health()
    serving: Counter[str] = Counter()
    for replica in body.get("replicas", []):
        if replica.get("healthy"):
            serving.update([replica["model"], *replica.get("adapters", [])])
    return serving
