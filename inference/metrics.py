"""The pool's Prometheus metrics: requests and latency per model, adapter loads and evictions, replicas.

One registry per pool process. Replica state is read when scraped (a collector), so it is never
stale and the hot path only bumps counters. Ray Serve's ingress shows the same series for its
models (``inference.ray_serve.app_metrics``): the names and help texts are these.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from inference.replica import Replica

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160)
_LOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)


@dataclass(frozen=True)
class ReplicaGauges:
    """What the replica series say of one replica, whichever backend runs it."""

    model: str
    replica: str  # the pool's: its URL; Ray Serve's: its replica id
    healthy: bool
    adapters_loaded: int
    inflight: int | None = None  # None: the backend does not say (Ray Serve counts them itself)
    restarts: int | None = None  # None: the backend replaces a failed replica by a new one (Ray Serve)
    lora_kernels: dict | None = None  # known once the replica has said
    asleep: bool = False  # its engine sleeps (a model scaled to zero, its process kept): healthy, not routed to


def _gauges_of(replica: Replica) -> ReplicaGauges:
    return ReplicaGauges(
        replica.model.id, replica.url, replica.healthy or replica.asleep, len(replica.adapters.held),
        inflight=replica.inflight, restarts=replica.restarts, lora_kernels=replica.lora_kernels, asleep=replica.asleep,
    )


def replica_families(replicas: Iterable[ReplicaGauges]) -> list[Metric]:
    """The replica series of these replicas (each family, even with no replica)."""
    labels = ["model", "replica"]
    healthy = GaugeMetricFamily(
        "fineserve_replica_healthy", "1 when the replica passes its health check", labels=labels
    )
    inflight = GaugeMetricFamily("fineserve_replica_inflight_requests", "Requests in flight", labels=labels)
    adapters = GaugeMetricFamily("fineserve_replica_adapters_loaded", "Adapters the replica holds", labels=labels)
    restarts = CounterMetricFamily("fineserve_replica_restarts", "Times the pool restarted the replica", labels=labels)
    asleep = GaugeMetricFamily(
        "fineserve_replica_asleep", "1 while the replica's engine sleeps (its KV cache given back)", labels=labels
    )
    kernels = GaugeMetricFamily(
        "fineserve_replica_lora_kernels",
        "1 for the LoRA kernels the replica runs (fineserve or stock), what LORA_KERNELS asked for, and why",
        labels=[*labels, "kernels", "requested", "reason"],
    )
    for replica in replicas:
        key = [replica.model, replica.replica]
        healthy.add_metric(key, 1.0 if replica.healthy else 0.0)
        asleep.add_metric(key, 1.0 if replica.asleep else 0.0)
        adapters.add_metric(key, replica.adapters_loaded)
        if replica.inflight is not None:
            inflight.add_metric(key, replica.inflight)
        if replica.restarts is not None:
            restarts.add_metric(key, replica.restarts)
        if replica.lora_kernels:
            said = [str(replica.lora_kernels.get(name)) for name in ("active", "requested", "reason")]
            kernels.add_metric([*key, *said], 1.0)
    return [healthy, asleep, inflight, adapters, restarts, kernels]


class _ReplicaCollector(Collector):
    def __init__(self, replicas: Callable[[], Iterable[ReplicaGauges]]):
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        yield from replica_families(self.replicas())


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "fineserve_inference_requests", "Completion requests by model and outcome",
            ["model", "endpoint", "status"], registry=r,
        )
        self.latency = Histogram(
            "fineserve_inference_request_seconds", "Time from request to the last byte of the answer",
            ["model", "endpoint"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.first_byte = Histogram(
            "fineserve_inference_first_byte_seconds", "Time to the first byte (the first token when streaming)",
            ["model", "endpoint"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.adapter_loads = Counter(
            "fineserve_adapter_loads", "Adapter loads into replicas", ["base_model", "outcome"], registry=r
        )
        self.adapter_evictions = Counter(
            "fineserve_adapter_evictions", "Adapters unloaded from replicas (lru, replaced, deleted)",
            ["base_model", "reason"], registry=r,
        )
        self.adapter_load_seconds = Histogram(
            "fineserve_adapter_load_seconds", "Time for a replica to load an adapter",
            ["base_model"], buckets=_LOAD_BUCKETS, registry=r,
        )
        self.background_waits = Counter(
            "fineserve_background_waits", "Background requests (a batch's lines) that waited for live ones on a replica",
            ["base_model"], registry=r,
        )
        self.adapter_downloads = Counter(
            "fineserve_adapter_downloads", "Adapters synced from S3 into the local cache", ["base_model"], registry=r
        )
        self.adapter_download_seconds = Histogram(
            "fineserve_adapter_download_seconds", "Time to sync an adapter from S3",
            ["base_model"], buckets=_LOAD_BUCKETS, registry=r,
        )

    def watch_replicas(self, replicas: Callable[[], Iterable[Replica]]) -> None:
        """The pool's replicas, read when scraped."""
        self.registry.register(_ReplicaCollector(lambda: map(_gauges_of, replicas())))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class CountedRequest:
    """One completion request in the counts, from its arrival to its last byte: the pool's handler
    and Ray Serve's ingress count by this one rule."""

    def __init__(self, metrics: Metrics, model: str, endpoint: str, started: float):
        self.metrics, self.model, self.endpoint, self.started = metrics, model, endpoint, started

    def first_byte(self) -> None:
        """A stream's first bytes went out."""
        self.metrics.first_byte.labels(self.model, self.endpoint).observe(time.perf_counter() - self.started)

    def finished(self, status: int, whole: bool = False) -> None:
        """Answered (or refused) with ``status``; its latency only when it succeeded. ``whole``: an
        answer sent in one piece, whose first byte was its last."""
        elapsed_s = time.perf_counter() - self.started
        self.metrics.requests.labels(self.model, self.endpoint, str(status)).inc()
        if status < 400:
            self.metrics.latency.labels(self.model, self.endpoint).observe(elapsed_s)
            if whole:
                self.metrics.first_byte.labels(self.model, self.endpoint).observe(elapsed_s)
