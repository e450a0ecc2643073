"""The pool: the replicas of every catalog model, started, stopped and probed for health.

Serverless behaviour (the catalog's ``autoscaling``, ``core.catalog.Autoscaling``): replicas past a
model's ``min_replicas`` are idle from the start. A model scaled to zero with ``idle = "sleep"``
keeps one of them asleep (started, then its engine's KV cache given back, the process kept); the
others are stopped ("cold"). A request that finds no replica of its model awake wakes or starts one
and waits for it (``ready_or_start``); another wakes or starts when every awake replica is
``target_ongoing_requests`` busy; one past the minimum falls idle again after ``downscale_delay_s``
with no request (``autoscale``).
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
        self.client: httpx.AsyncClient | None = None  # the supervisor's, to wake a replica at once
        port = first_replica_port
        for model in catalog.models:
            replicas = replicas_for(model, port, internal_token)
            for replica in replicas[model.autoscaling.min_replicas : model.replicas]:  # the local ones past the minimum
                _fall_idle(replica, replicas)
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
        if self.client is not None:  # an asleep replica wakes now, not at the next tick
            await asyncio.gather(*(replica.sleep_or_wake(self.client) for replica in self._managed(model.id)))
        deadline = time.monotonic() + model.autoscaling.cold_start_wait_s
        while not (ready := self.ready(model.id)):
            if refused := self._start_refused(model.id):
                raise api_errors.model_does_not_fit(model.id, refused)
            if time.monotonic() >= deadline:
                raise api_errors.model_starting(model.id, COLD_START_RETRY_AFTER_S)
            await asyncio.sleep(_WAIT_POLL_S)
        return ready

    def _start_refused(self, model_id: str) -> str | None:
        """Why the replica a request woke was not started (the memory plan), if it was not."""
        return next(
            (r.start_refused for r in self._managed(model_id) if r.woken_at is not None and r.start_refused), None
        )

    def _wake(self, model_id: str, now: float) -> bool:
        """Wake or start an idle replica of a model none of whose replicas is awake; whether one is
        waking or starting on a request's behalf now."""
        managed = self._managed(model_id)
        if any(replica.woken_at is not None for replica in managed):
            return True
        if any(_awake(replica) for replica in managed):
            return False  # starting by itself (after a crash): not waited for
        idle = _next_to_wake(managed)
        if idle is None:
            return False
        _wake_up(idle)
        idle.woken_at = now
        idle.supervise(now)  # a stopped one starts now, not at the next tick
        return True

    def autoscale(self, now: float) -> None:
        for model in self.catalog.models:
            managed, scaling = self._managed(model.id), model.autoscaling
            awake = [replica for replica in managed if _awake(replica)]
            ready = [replica for replica in awake if replica.healthy]
            busy = ready and all(replica.inflight >= scaling.target_ongoing_requests for replica in ready)
            if busy and len(ready) == len(awake):  # none already starting
                idle = _next_to_wake(managed)
                if idle is not None:
                    _wake_up(idle)
                continue
            spare = len(awake) - scaling.min_replicas
            for replica in reversed(ready):
                idle_s = now - replica.last_active_at
                if spare > 0 and replica.inflight == 0 and idle_s >= scaling.downscale_delay_s:
                    _fall_idle(replica, managed)
                    spare -= 1

    async def supervise_forever(self, client: httpx.AsyncClient) -> None:
        """Scale, start what is wanted and not running, stop what is not wanted, and probe every
        replica, each second, whatever goes wrong."""
        self.client = client
        await every(SUPERVISE_INTERVAL_S, lambda: self.supervise_once(client), "supervising the replicas")

    async def supervise_once(self, client: httpx.AsyncClient) -> None:
        now = time.monotonic()
        self.autoscale(now)
        for replica in self.replicas:
            replica.supervise(now)
        await asyncio.gather(*(replica.probe(client) for replica in self.replicas))
        await asyncio.gather(*(replica.sleep_or_wake(client) for replica in self.replicas))

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()

    def model_states(self) -> dict[str, dict]:
        """Each base model's serving state: "ready" on N replicas, "waking" (from asleep),
        "starting", "asleep" (none awake, by choice: the next request wakes one in a fraction of a second),
        or "cold" (none runs, by choice: the next request starts one)."""
        states = {}
        for model in self.catalog.models:
            replicas = [replica for replica in self.replicas if replica.model.id == model.id]
            ready = sum(replica.healthy for replica in replicas)
            states[model.id] = {"state": "ready" if ready else _idle_state(replicas), "ready_replicas": ready}
        return states

    def health(self) -> dict:
        ready, models = self.ready(), self.model_states()
        serving = bool(ready) or all(state["state"] in IDLE_STATES for state in models.values())
        return {
            "ready_replicas": len(ready),
            "serving": serving,  # every model answers now, or starts on its next request
            "detail": "ok" if serving else "no replica is ready yet (vLLM takes about a minute to start on a CPU)",
            "models": models,
            "replicas": [replica.status() for replica in self.replicas],
        }


IDLE_STATES = ("asleep", "cold")  # a model idle by choice: the next request wakes or starts it


def _idle_state(replicas: list[Replica]) -> str:
    """A model none of whose replicas is ready: "waking", "starting", "asleep" or "cold"."""
    states = {replica.state for replica in replicas}
    for state in ("waking", "starting"):
        if state in states:
            return state
    return "asleep" if "asleep" in states else "cold"


def _awake(replica: Replica) -> bool:
    """Running, or starting, with the pool wanting its engine awake."""
    return replica.wanted and not replica.sleep_wanted


def _next_to_wake(replicas: list[Replica]) -> Replica | None:
    """The idle replica to wake or start next: an asleep one first (a fraction of a second), then a stopped one."""
    asleep = (replica for replica in replicas if replica.wanted and replica.sleep_wanted)
    return next(asleep, None) or next((replica for replica in replicas if not replica.wanted), None)


def _wake_up(replica: Replica) -> None:
    """The pool wants it awake: an asleep one wakes, a stopped one starts."""
    replica.wanted, replica.sleep_wanted = True, False


def _fall_idle(replica: Replica, replicas: list[Replica]) -> None:
    """The pool wants it idle: asleep (its process kept) if its model is scaled to zero with
    ``idle = "sleep"`` and none of the model's other ``replicas`` is kept asleep; stopped otherwise."""
    if replica.model.autoscaling.keeps_one_asleep and not any(other.wanted and other.sleep_wanted for other in replicas if other is not replica):
        replica.sleep_wanted = True
    else:
        replica.wanted = False
