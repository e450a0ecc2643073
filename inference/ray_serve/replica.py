"""One Ray Serve replica of a catalog model.

It runs the same vLLM OpenAI server the embedded pool runs (``inference.engine.server``: vLLM's own
server with our CPU LoRA kernels, the catalog's engine settings, the internal token), on a
loopback port of its Ray worker's host, and relays requests to it. So the JSON mode, streaming and
answers are the embedded pool's, token for token, and the kernels apply without reaching into the
processes vLLM spawns. Ray restarts the replica when ``check_health`` fails (the server died).

Adapters are Ray Serve's multiplexed models: Ray routes a request for ``<base>:<suffix>@rN`` (at
the publish the store has now, ``replica_adapters.routing_id``) to a replica that holds it, and this
replica loads it on its first request, read from the dynamic LoRA path through the same
checksum-verified cache the pool uses (``inference.adapter_source``): on another host, that path is
S3, never a folder on the publisher's disk. Which adapters a full replica keeps is decided as on the
pool, fairly between organizations (``inference.ray_serve.replica_adapters``), and an unload waits
for the adapter's requests to end. A deleted adapter leaves within seconds, and a cached copy leaves
with its adapter; the replica's cache goes with the replica.

A mix (``adapters``) comes with its request (``answer``'s ``mix``, the parts at the versions the
ingress saw published), routed by its first part's id, and is computed in the kernel as on the pool:
the replica holds each part as a multiplexed model, then the mix's manifest
(``ReplicaAdapters.hold_mix``); the parts count in vLLM's batch slots as the pool counts them. A
replica whose kernels fell back (their check failed) refuses mixes and says why.

A model scaled to zero with ``idle = "sleep"`` keeps one replica, whose engine sleeps while idle and
wakes for the next request (``idle_engine``).

A request is a stream of items from ``answer``: ``STARTED`` at once (the ingress stops counting a
cold start there), then a ``Head``, then the body's bytes. ``metrics_report`` is what the replica
tells the ingress's /metrics (``inference.ray_serve.app_metrics``).
"""

from __future__ import annotations

import logging
import shutil
import socket
import tempfile
import time
from collections import Counter
from contextvars import ContextVar
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from core import api_errors
from core.adapter_store import store_of
from core.catalog import BaseModel
from core.config import load_config
from core.http_client import HttpClient, UpstreamError
from core.internal_token import bearer
from inference.adapter_mix import Mix, refuse_past_batch_slots
from inference.adapter_slots import FairUse, fits_batch_slots
from inference.adapter_source import AdapterSource
from inference.adapters import BATCH_TURN_WAIT_S
from inference.background_turns import BackgroundTurns
from inference.engine_contract import REPORT_PATH, computes_mixes
from inference.metrics import Metrics
from inference.ray_serve.app_metrics import ReplicaReport
from inference.ray_serve.replica_adapters import (
    ROUTING_MEMORY,
    ReplicaAdapters,
    ServedAdapter,
    routing_id,
    served_name,
)
from inference.ray_serve.idle_engine import IdleEngine
from inference.replica import batch_slots, start_vllm_server, stop_vllm_server, vllm_environment

log = logging.getLogger("inference.ray_serve.replica")

STARTED = "started"
ENGINE_START_TIMEOUT_S = 900.0
_POLL_S = 0.5
_ADMIN_TIMEOUT_S = 60.0
# Whose request is loading an adapter: Ray's loader runs in the request's own task, but takes the id only.
_ORGANIZATION: ContextVar[str | None] = ContextVar("organization", default=None)


@dataclass(frozen=True)
class Head:
    status: int
    content_type: str


class VllmReplica:
    def __init__(self, model: BaseModel):
        config = load_config()
        self.model = model
        self.token = config.internal_token
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        environment = vllm_environment(model, self.token)
        # Ray sets OMP_NUM_THREADS to the actor's num_cpus (1), which would hold the engine to one
        # core (0.65x the pool's tokens/s on two cores, benchmarks/backends_bench.py): its threads
        # are vLLM's to choose, as on the embedded pool.
        environment.pop("OMP_NUM_THREADS", None)
        self.process = start_vllm_server(model, self.port, environment)
        self.admin = httpx.AsyncClient(headers={"Authorization": bearer(self.token)}, timeout=_ADMIN_TIMEOUT_S)
        self.http = HttpClient(headers={"Authorization": bearer(self.token)})
        self.cache = Path(
            tempfile.mkdtemp(prefix="adapter-cache-", dir=config.data_dir if config.data_dir.is_dir() else None)
        )
        store = store_of(model, config.s3)
        self.metrics = Metrics()  # adapter loads, evictions, downloads, background waits: requests are the ingress's
        self.turns = BackgroundTurns(self.metrics.background_waits.labels(model.id).inc)  # reported as the pool's
        source = AdapterSource(store, self.cache, self.metrics, model.id)
        capacity = model.lora.max_num_adapters_per_replica
        fair_use = FairUse.of(model.lora, batch_slots(model))
        self.adapters = ReplicaAdapters(source, self.admin, self.url, model.lora.max_lora_rank, capacity, fair_use)
        self.inflight_by_model: Counter[str] = Counter()  # requests under way, by adapter or mix name
        self.idle = IdleEngine(model, self.admin, self.url)  # asleep while idle, scaled to zero
        self._wait_until_ready()
        # What the engine said about its LoRA kernels (``inference.engine_contract.KernelsState``).
        self.lora_kernels: dict | None = httpx.get(f"{self.url}{REPORT_PATH}", headers=self.admin.headers).json()
        from ray import serve

        async def load(multiplexed_id: str) -> ServedAdapter:  # a function: Serve keeps its LRU cache on it
            return await self.adapters.load(multiplexed_id, _ORGANIZATION.get())

        self.adapter = serve.multiplexed(max_num_models_per_replica=capacity * ROUTING_MEMORY)(load)

    def _wait_until_ready(self) -> None:
        """Serve counts the replica as starting until this returns: no request reaches it before."""
        deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with {self.process.returncode} while starting")
            try:
                if httpx.get(f"{self.url}/health", headers={"Authorization": bearer(self.token)}).status_code == 200:
                    log.info("vLLM server for %s ready on port %d", self.model.id, self.port)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(_POLL_S)
        raise RuntimeError(f"the vLLM server did not become ready in {ENGINE_START_TIMEOUT_S:.0f} s")

    async def check_health(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {self.process.returncode}")
        response = await self.admin.get(f"{self.url}/health", timeout=10.0)
        if response.status_code != 200:
            raise RuntimeError(f"the vLLM server's health check answered {response.status_code}")
        await self.idle.sleep_if_idle()

    async def answer(
        self,
        endpoint: str,
        body: bytes,
        background: bool = False,
        organization: str | None = None,
        mix: Mix | None = None,
    ) -> AsyncIterator[object]:
        """``background``: work nobody reads token by token, which yields to live requests here
        (``inference.background_turns``); ``organization``: whose request it is, for its share of
        vLLM's batch slots (``AdapterSlots.batch_turn``); ``mix``: the mix the body names. All as on
        the embedded pool's replicas."""
        yield STARTED
        routed_as = _multiplexed_model_id()
        name = mix.name if mix is not None else served_name(routed_as)
        held: list[str] = []  # what the engine answers with: not unloaded until the request ends
        started = False
        self.idle.begin()

        def uses(adapter: str) -> None:  # called as each is held, with no pause between
            held.append(adapter)
            self.adapters.slots.started(adapter)

        try:
            await self.idle.awake()
            await self._hold(routed_as, mix, organization, uses)
            if routed_as:
                await self._batch_turn(name, organization)
                self.inflight_by_model[name] += 1
                started = True
            async with self.turns.turn(background):
                upstream = await self.http.post(f"{self.url}/v1/{endpoint}", body)
                try:
                    yield Head(upstream.status, upstream.headers.get("content-type", "application/json"))
                    async for chunk in upstream.iter_body():
                        yield chunk
                finally:
                    upstream.close()  # a caller that went away: the server sees the drop and stops generating
        except api_errors.ApiError as exc:
            yield Head(exc.status, "application/json")
            yield exc.json_bytes()
        except UpstreamError as exc:
            failure = api_errors.replica_lost(str(exc))
            yield Head(failure.status, "application/json")
            yield failure.json_bytes()
        finally:
            self.idle.end()
            if started:
                self.inflight_by_model[name] -= 1
                if self.inflight_by_model[name] <= 0:
                    del self.inflight_by_model[name]
            for adapter in held:
                self.adapters.slots.finished(adapter)

    async def _hold(self, routed_as: str, mix: Mix | None, organization: str | None, uses: Callable[[str], None]) -> None:
        """Make the engine hold what the request names: its adapter (``routed_as``, Ray's multiplexed
        model), or a mix's parts and manifest; ``uses`` each, once held."""
        _ORGANIZATION.set(organization)  # for Ray's loader (this task's context only)
        if mix is None:
            if routed_as:
                await self._hold_adapter(routed_as, organization)
                uses(served_name(routed_as))
            return
        if not computes_mixes(self.lora_kernels):
            raise api_errors.mix_not_supported(self.model.id, (self.lora_kernels or {}).get("reason") or "")
        refuse_past_batch_slots(mix.part_names, batch_slots(self.model))
        for part in mix.parts:
            await self._hold_adapter(routing_id(part.pinned, part.version), organization)
            uses(part.pinned)
        await self.adapters.hold_mix(mix, organization)
        uses(mix.name)

    async def _hold_adapter(self, multiplexed_id: str, organization: str | None) -> None:
        """Ray's cache first (it routes by it), then the replica's own slots, which may have let the
        adapter go since Ray loaded it (``ReplicaAdapters.ensure``: at once when held)."""
        await self.adapter(multiplexed_id)
        await self.adapters.ensure(multiplexed_id, organization)

    async def _batch_turn(self, name: str, organization: str | None) -> None:
        """Return when the organization's request for ``name`` (an adapter or a mix) may start here:
        at once, or once its adapters fit vLLM's batch slots and some of its own requests with other
        adapters have finished while another organization's are under way or waiting; refused after
        ``BATCH_TURN_WAIT_S`` (429 ``adapter_slots_busy``). As ``AdapterManager.batch_turn`` on the pool."""
        slots, limit = self.adapters.slots, batch_slots(self.model)

        def may_start() -> bool:
            under_way = [self.adapters.slots_of(model) for model in self.inflight_by_model]
            return fits_batch_slots(self.adapters.slots_of(name), under_way, limit) and (
                organization is None or slots.batch_turn(name, organization, self.inflight_by_model)
            )

        await slots.wait_for_turn(
            organization, may_start, BATCH_TURN_WAIT_S,
            lambda: api_errors.adapter_slots_busy(self.model.id, "batch", slots.fair_use.batch_share or limit),
        )

    async def preload(self) -> str:
        """Load the request's adapter here (the replica Ray routes its name to); its name."""
        routed_as = _multiplexed_model_id()
        await self._hold_adapter(routed_as, None)
        return served_name(routed_as)

    async def metrics_report(self) -> ReplicaReport:
        """What this replica's metrics say now (the ingress asks every replica when it is scraped); on
        the replica's event loop, which alone changes what it reads."""
        from ray import serve

        replica = serve.get_replica_context().replica_id.unique_id
        return ReplicaReport.of(replica, self.model.id, len(self.adapters.slots.held), self.metrics, self.idle.asleep)

    def __del__(self) -> None:
        """Serve stopping the replica: the server and the engine it spawned, and its adapter cache."""
        process = getattr(self, "process", None)
        if process is not None and process.poll() is None:
            stop_vllm_server(process)
        cache = getattr(self, "cache", None)
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)


def _multiplexed_model_id() -> str:
    from ray import serve

    return serve.get_multiplexed_model_id()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
