"""The pool's Prometheus metrics: requests and latency per model, adapter loads and evictions, replicas.

One registry per pool process. Replica state is read when scraped (a collector), so it is never
stale and the hot path only bumps counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160)
_LOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)


class _ReplicaCollector(Collector):
    def __init__(self, replicas: Callable[[], Iterable]):
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "replica"]
        healthy = GaugeMetricFamily(
            "fineserve_replica_healthy", "1 when the replica passes its health check", labels=labels
        )
        inflight = GaugeMetricFamily("fineserve_replica_inflight_requests", "Requests in flight", labels=labels)
        adapters = GaugeMetricFamily("fineserve_replica_adapters_loaded", "Adapters the replica holds", labels=labels)
        restarts = CounterMetricFamily(
            "fineserve_replica_restarts", "Times the pool restarted the replica", labels=labels
        )
        kernels = GaugeMetricFamily(
            "fineserve_replica_lora_kernels",
            "1 for the LoRA kernels the replica runs (fineserve or stock), what LORA_KERNELS asked for, and why",
            labels=[*labels, "kernels", "requested", "reason"],
        )
        for replica in self.replicas():
            key = [replica.model.id, replica.url]
            healthy.add_metric(key, 1.0 if replica.healthy else 0.0)
            inflight.add_metric(key, replica.inflight)
            adapters.add_metric(key, len(replica.adapters.held))
            restarts.add_metric(key, replica.restarts)
            if replica.lora_kernels:  # known once the replica has said
                said = [str(replica.lora_kernels.get(name)) for name in ("active", "requested", "reason")]
                kernels.add_metric([*key, *said], 1.0)
        yield from (healthy, inflight, adapters, restarts, kernels)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "fineserve_inference_requests", "Completion requests by model and outcome",
            ["model", "endpoint", "status"], registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            "fineserve_inference_request_seconds", "Time from request to the last byte of the answer",
            ["model", "endpoint"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.first_byte = Histogram(
            "fineserve_inference_first_byte_seconds", "Time to the first byte (the first token when streaming)",
            ["model", "endpoint"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.adapter_loads = Counter(
            "fineserve_adapter_loads", "Adapter loads into replicas", ["base_model", "outcome"], registry=r
        )
        self.adapter_evictions = Counter(
            "fineserve_adapter_evictions", "Adapters unloaded from replicas (lru, replaced, deleted)",
            ["base_model", "reason"], registry=r,
        )  # fmt: skip
        self.adapter_load_seconds = Histogram(
            "fineserve_adapter_load_seconds", "Time for a replica to load an adapter",
            ["base_model"], buckets=_LOAD_BUCKETS, registry=r,
        )  # fmt: skip
        self.adapter_downloads = Counter(
            "fineserve_adapter_downloads", "Adapters synced from S3 into the local cache", ["base_model"], registry=r
        )
        self.adapter_download_seconds = Histogram(
            "fineserve_adapter_download_seconds", "Time to sync an adapter from S3",
            ["base_model"], buckets=_LOAD_BUCKETS, registry=r,
        )  # fmt: skip

    def watch_replicas(self, replicas: Callable[[], Iterable]) -> None:
        self.registry.register(_ReplicaCollector(replicas))

    def render(self) -> bytes:
        return generate_latest(self.registry)
