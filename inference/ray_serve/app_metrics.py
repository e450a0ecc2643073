"""The Ray Serve application's /metrics: the embedded pool's series (``inference.metrics``), added up
over the processes that count them.

The ingress sees every request: it counts requests, latency and first bytes in a ``Metrics`` of its
own, as the pool's handler does. Each replica counts its adapters' loads, evictions and downloads
in its own. When the ingress is scraped, it asks every running replica for a ``ReplicaReport`` (a
Serve broadcast: a handle's call reaches one replica only) and shows one text: a sample several
processes have (same name, same labels) once, with their sum.

A replica that stopped stays in the sum with what it said last, so a counter never goes back
(Prometheus would read the drop as a restart and count the whole sum again). The replica series
(healthy, adapters held) are those of the replicas that answered this scrape: Serve runs them.
The application has one ingress (``app.build_app``): with more, each would count only the requests
it relayed, and a scrape would reach one of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from inference.metrics import Metrics, ReplicaGauges, replica_families


@dataclass(frozen=True)
class ReplicaReport:
    """What one Ray Serve replica says when the ingress is scraped (it travels by pickle)."""

    replica: str  # Serve's id for it
    model: str
    adapters_loaded: int
    families: list[Metric]  # its ``Metrics``: adapter loads, evictions, downloads
    asleep: bool = False  # its engine sleeps (a model scaled to zero with ``idle = "sleep"``)

    @classmethod
    def of(cls, replica: str, model: str, adapters_loaded: int, metrics: Metrics, asleep: bool = False) -> ReplicaReport:
        return cls(replica, model, adapters_loaded, list(metrics.registry.collect()), asleep)

    def gauges(self) -> ReplicaGauges:
        return ReplicaGauges(
            self.model, self.replica, healthy=True, adapters_loaded=self.adapters_loaded, asleep=self.asleep
        )


class AppMetrics:
    """The ingress's own counts and what the replicas last said, shown as one."""

    def __init__(self) -> None:
        self.ingress = Metrics()  # requests, latency, first bytes: counted as the ingress answers
        self._said: dict[str, ReplicaReport] = {}  # by replica id: the last report of each running replica
        self._stopped: list[Metric] = []  # the last reports of the replicas that stopped, added up

    def heard(self, model: str, reports: list[ReplicaReport], everyone: bool) -> None:
        """A model's replicas' reports to this scrape. ``everyone``: every replica Serve runs for the
        model answered, so one that answered before and not now has stopped."""
        if everyone:
            answered = {report.replica for report in reports}
            for replica, report in list(self._said.items()):
                if report.model == model and replica not in answered:
                    self._stopped = summed(self._stopped, report.families)
                    del self._said[replica]
        self._said |= {report.replica: report for report in reports}

    def render(self, answered: Iterable[ReplicaReport]) -> bytes:
        """The text for /metrics; ``answered``: the reports of this scrape (the replica series)."""
        families = summed(
            self.ingress.registry.collect(), self._stopped, *(report.families for report in self._said.values())
        )
        registry = CollectorRegistry()
        registry.register(_Given([*families, *replica_families(report.gauges() for report in answered)]))
        return generate_latest(registry)


def summed(*sources: Iterable[Metric]) -> list[Metric]:
    """Several processes' metric families as one: each family once, and each of its samples (by name
    and labels) once, with the values added up; a ``_created`` time is the earliest."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for source in sources:
        for family in source:
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                values[family.name] = {}
            known = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                before = known.get(key)
                if before is None:
                    known[key] = sample.value
                elif sample.name.endswith("_created"):
                    known[key] = min(before, sample.value)
                else:
                    known[key] = before + sample.value
    for name, family in families.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
    return list(families.values())


class _Given(Collector):
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families
