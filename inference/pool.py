"""The pool: the replicas of every catalog model, started, stopped and probed for health.

Serverless behaviour (the catalog's ``autoscaling``, ``core.catalog.Autoscaling``): replicas past a
model's ``min_replicas`` start stopped ("cold"). A request that finds its model with no replica
running starts one and waits for it (``ready_or_start``); another starts when every running
replica is ``target_ongoing_requests`` busy; one past the minimum stops after
``downscale_delay_s`` with no request (``autoscale``).
"""

from __future__ import annotations

import asyncio
import time

import httpx

from core import api_errors
from core.catalog import Catalog
from inference.periodic import every
from inference.replica import Replica, replicas_for

SUPERVISE_INTERVAL_S = 1.0
_WAIT_POLL_S = 0.25
COLD_START_RETRY_AFTER_S = 10  # what a request that waited in vain is told: a CPU engine starts in about a minute


class Pool:
    def __init__(self, catalog: Catalog, first_replica_port: int, internal_token: str):
        self.catalog = catalog
        self.replicas: list[Replica] = []
        port = first_replica_port
        for model in catalog.models:
            replicas = replicas_for(model, port, internal_token)
            for replica in replicas[model.autoscaling.min_replicas : model.replicas]:  # the local ones past the minimum
                replica.wanted = False
            self.replicas += replicas
            port += model.replicas

    def ready(self, model_id: str | None = None) -> list[Replica]:
        return [r for r in self.replicas if r.healthy and (model_id is None or r.model.id == model_id)]

    def _managed(self, model_id: str) -> list[Replica]:
        return [r for r in self.replicas if r.managed and r.model.id == model_id]

    async def ready_or_start(self, model_id: str) -> list[Replica]:
        """A catalog model's ready replicas; when it has none because it is cold, start one and
        wait for it up to its ``cold_start_wait_s``, then a 503 with Retry-After. A model whose
        replicas are restarting by themselves (a crash) is not waited for: the caller answers at once."""
        model = self.catalog.get(model_id)
        assert model is not None, "only a catalog model has replicas"
        ready = self.ready(model.id)
        if ready or not self._wake(model.id, time.monotonic()):
            return ready
        deadline = time.monotonic() + model.autoscaling.cold_start_wait_s
        while time.monotonic() < deadline:
            if refused := self._start_refused(model.id):
                raise api_errors.model_does_not_fit(model.id, refused)
            await asyncio.sleep(_WAIT_POLL_S)
            if ready := self.ready(model.id):
                return ready
        raise api_errors.model_starting(model.id, COLD_START_RETRY_AFTER_S)

    def _start_refused(self, model_id: str) -> str | None:
        """Why the replica a request woke was not started (the memory plan), if it was not."""
        return next(
            (r.start_refused for r in self._managed(model_id) if r.woken_at is not None and r.start_refused), None
        )

    def _wake(self, model_id: str, now: float) -> bool:
        """Start a stopped replica of a model none of whose replicas runs; whether one is starting
        on a request's behalf now."""
        managed = self._managed(model_id)
        if any(replica.woken_at is not None for replica in managed):
            return True
        if any(replica.wanted for replica in managed):
            return False
        cold = _first_cold(managed)
        if cold is None:
            return False
        cold.wanted, cold.woken_at = True, now
        cold.supervise(now)  # now, not at the next tick
        return True

    def autoscale(self, now: float) -> None:
        for model in self.catalog.models:
            managed, scaling = self._managed(model.id), model.autoscaling
            running = [replica for replica in managed if replica.wanted]
            ready = [replica for replica in running if replica.healthy]
            busy = ready and all(replica.inflight >= scaling.target_ongoing_requests for replica in ready)
            if busy and len(ready) == len(running):  # none already starting
                cold = _first_cold(managed)
                if cold is not None:
                    cold.wanted = True
                continue
            spare = len(running) - scaling.min_replicas
            for replica in reversed(ready):
                idle_s = now - replica.last_active_at
                if spare > 0 and replica.inflight == 0 and idle_s >= scaling.downscale_delay_s:
                    replica.wanted, spare = False, spare - 1

    async def supervise_forever(self, client: httpx.AsyncClient) -> None:
        """Scale, start what is wanted and not running, stop what is not wanted, and probe every
        replica, each second, whatever goes wrong."""
        await every(SUPERVISE_INTERVAL_S, lambda: self.supervise_once(client), "supervising the replicas")

    async def supervise_once(self, client: httpx.AsyncClient) -> None:
        now = time.monotonic()
        self.autoscale(now)
        for replica in self.replicas:
            replica.supervise(now)
        await asyncio.gather(*(replica.probe(client) for replica in self.replicas))

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()

    def model_states(self) -> dict[str, dict]:
        """Each base model's serving state: "ready" on N replicas, "starting", or "cold" (none runs,
        by choice: the next request starts one)."""
        states = {}
        for model in self.catalog.models:
            replicas = [replica for replica in self.replicas if replica.model.id == model.id]
            ready = sum(replica.healthy for replica in replicas)
            cold = all(replica.state in ("cold", "stopping") for replica in replicas)
            states[model.id] = {"state": "ready" if ready else "cold" if cold else "starting", "ready_replicas": ready}
        return states

    def health(self) -> dict:
        ready, models = self.ready(), self.model_states()
        serving = bool(ready) or all(state["state"] == "cold" for state in models.values())
        return {
            "ready_replicas": len(ready),
            "serving": serving,  # every model answers now, or starts on its next request
            "detail": "ok" if serving else "no replica is ready yet (vLLM takes about a minute to start on a CPU)",
            "models": models,
            "replicas": [replica.status() for replica in self.replicas],
        }


def _first_cold(replicas: list[Replica]) -> Replica | None:
    """The first of these replicas the pool does not want running: the next to start."""
    return next((replica for replica in replicas if not replica.wanted), None)
