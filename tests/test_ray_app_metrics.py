"""The Ray Serve application's /metrics text (``inference.ray_serve.app_metrics``), no Ray: the
ingress's own counts and its replicas' reports added up under the embedded pool's series."""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from core.catalog import load_catalog
from core.config import load_config
from inference.metrics import CountedRequest, Metrics
from inference.ray_serve.app_metrics import AppMetrics, ReplicaReport
from tests.inference_fixtures import BASE, catalog_text


def _value(text: bytes, sample: str, **labels: str) -> float | None:
    """A sample's value in a Prometheus text (None: it has none)."""
    for family in text_string_to_metric_families(text.decode()):
        for found in family.samples:
            if found.name == sample and found.labels == labels:
                return found.value
    return None


def _report(replica: str, metrics: Metrics, adapters_loaded: int) -> ReplicaReport:
    """A replica's report as the ingress receives it: pickled across Ray's processes."""
    return pickle.loads(pickle.dumps(ReplicaReport.of(replica, BASE, adapters_loaded, metrics)))


def _replica_metrics(loads: int, load_seconds: float) -> Metrics:
    metrics = Metrics()
    for _ in range(loads):
        metrics.adapter_loads.labels(BASE, "loaded").inc()
        metrics.adapter_load_seconds.labels(BASE).observe(load_seconds)
    return metrics


def test_it_adds_up_what_the_replicas_report_under_the_pools_series():
    first, second = _replica_metrics(2, 0.1), _replica_metrics(1, 0.3)
    first.adapter_evictions.labels(BASE, "lru").inc()
    app = AppMetrics()
    reports = [_report("r1", first, adapters_loaded=2), _report("r2", second, adapters_loaded=1)]
    app.heard(BASE, reports, everyone=True)
    text = app.render(reports)

    assert _value(text, "fineserve_adapter_loads_total", base_model=BASE, outcome="loaded") == 3
    assert _value(text, "fineserve_adapter_evictions_total", base_model=BASE, reason="lru") == 1
    assert _value(text, "fineserve_adapter_load_seconds_bucket", base_model=BASE, le="0.25") == 2
    assert _value(text, "fineserve_adapter_load_seconds_count", base_model=BASE) == 3
    assert _value(text, "fineserve_adapter_load_seconds_sum", base_model=BASE) == 0.5
    assert _value(text, "fineserve_replica_healthy", model=BASE, replica="r1") == 1
    assert _value(text, "fineserve_replica_adapters_loaded", model=BASE, replica="r2") == 1
    for family in ("fineserve_adapter_loads_total", "fineserve_inference_requests_total", "fineserve_replica_healthy"):
        assert text.count(f"# TYPE {family} ".encode()) == 1  # each family once, as in the pool's text


def test_a_stopped_replicas_counts_stay_so_no_counter_goes_back():
    first, second = _replica_metrics(2, 0.1), _replica_metrics(1, 0.1)
    app = AppMetrics()
    app.heard(BASE, [_report("r1", first, 2), _report("r2", second, 1)], everyone=True)
    first.adapter_loads.labels(BASE, "loaded").inc()

    late = [_report("r1", first, 2)]
    app.heard(BASE, late, everyone=False)  # r2 did not answer in time: it may still run
    text = app.render(late)
    assert _value(text, "fineserve_adapter_loads_total", base_model=BASE, outcome="loaded") == 4
    assert _value(text, "fineserve_replica_healthy", model=BASE, replica="r2") is None  # only who answered

    app.heard(BASE, late, everyone=True)  # every running replica answered: r2 has stopped
    app.heard(BASE, late, everyone=True)  # and is counted once, however many scrapes follow
    text = app.render(late)
    assert _value(text, "fineserve_adapter_loads_total", base_model=BASE, outcome="loaded") == 4
    app.heard(BASE, [], everyone=True)  # scaled to zero
    assert _value(app.render([]), "fineserve_adapter_loads_total", base_model=BASE, outcome="loaded") == 4


def test_the_ingress_counts_requests_by_the_pools_rule():
    app, name = AppMetrics(), f"{BASE}:tuned"
    CountedRequest(app.ingress, name, "chat/completions", started=0.0).finished(200, whole=True)
    streamed = CountedRequest(app.ingress, BASE, "completions", started=0.0)
    streamed.first_byte()
    streamed.finished(200)
    CountedRequest(app.ingress, name, "chat/completions", started=0.0).finished(503)
    text = app.render([])

    assert _value(text, "fineserve_inference_requests_total", model=name, endpoint="chat/completions", status="200") == 1
    assert _value(text, "fineserve_inference_requests_total", model=name, endpoint="chat/completions", status="503") == 1
    assert _value(text, "fineserve_inference_request_seconds_count", model=name, endpoint="chat/completions") == 1
    assert _value(text, "fineserve_inference_first_byte_seconds_count", model=name, endpoint="chat/completions") == 1
    assert _value(text, "fineserve_inference_first_byte_seconds_count", model=BASE, endpoint="completions") == 1
    assert _value(text, "fineserve_inference_request_seconds_count", model=BASE, endpoint="completions") == 1


class _Replicas:
    """A stand-in for a model's Serve deployment handle: its broadcast gets these answers."""

    def __init__(self, *answers: object):
        self.answers = list(answers)

    def broadcast(self, method: str) -> _Replicas:
        assert method == "metrics_report"
        return self

    async def results_async(self, timeout_s: float, return_exceptions: bool) -> list[object]:
        assert return_exceptions  # one slow replica must not hide the others
        return self.answers


def test_the_ingress_answers_metrics_from_its_replicas_to_the_internal_token_only(tmp_path: Path, monkeypatch):
    from starlette.requests import Request

    from inference.ray_serve.ingress import Ingress

    (tmp_path / "models.toml").write_text(catalog_text("ray"))
    model = load_catalog(tmp_path / "models.toml", tmp_path, str(tmp_path / "adapters")).require(BASE)
    replicas = _Replicas(_report("r1", _replica_metrics(2, 0.1), 2), TimeoutError("r2 is slow"))
    ingress = Ingress({BASE: replicas}, (model,), "test")

    async def states() -> dict[str, dict[str, int]]:
        return {BASE: {"RUNNING": 2}}

    monkeypatch.setattr(ingress, "_replica_states", states)  # what serve.status would say

    def scrape(authorization: str) -> tuple[int, bytes]:
        headers = [(b"authorization", authorization.encode())] if authorization else []
        scope = {"type": "http", "method": "GET", "path": "/metrics", "headers": headers, "query_string": b""}
        response = asyncio.run(ingress(Request(scope)))
        return response.status_code, bytes(response.body)

    assert scrape("")[0] == 401
    status, text = scrape(f"Bearer {load_config().internal_token}")
    assert status == 200
    assert _value(text, "fineserve_adapter_loads_total", base_model=BASE, outcome="loaded") == 2
    assert _value(text, "fineserve_replica_healthy", model=BASE, replica="r1") == 1
    assert _value(text, "fineserve_replica_healthy", model=BASE, replica="r2") is None
