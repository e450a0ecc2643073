"""The Ray Serve backend's ingress and one replica, in this process, with no Ray and no engine: the
stand-in for tests/mix_pool.py's ``TenantPool``, so the pool's fair-use and mix cases run on Ray's
code too (the parts Ray itself does, routing and its cache of multiplexed ids, are faked here).

The ingress (``inference.ray_serve.ingress.Ingress``) and the replica
(``inference.ray_serve.replica.VllmReplica``: its adapters, batch turns and mixes) are the real ones;
the replica's vLLM server is tests/fake_pool.py's ``FakeVllm``, which reports mixes in the kernel.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from core.catalog import Catalog
from inference.adapter_slots import FairUse
from inference.adapter_source import AdapterSource
from inference.background_turns import BackgroundTurns
from inference.metrics import Metrics
from inference.ray_serve import replica as ray_replica
from inference.ray_serve.idle_engine import IdleEngine
from inference.ray_serve.app_metrics import AppMetrics
from inference.ray_serve.ingress import Ingress
from inference.ray_serve.replica_adapters import ROUTING_MEMORY, ReplicaAdapters
from inference.replica import batch_slots
from inference.server import admin_client
from tests.fake_pool import INTERNAL, TOKEN, HttpxPoster, _base_model
from tests.mix_pool import REPLICA, TenantPool, kernel_mixing

_ROUTED: ContextVar[str] = ContextVar("routed", default="")  # the request's multiplexed model id


class RayCache:
    """Serve's cache of one replica's multiplexed ids (``serve.multiplexed``): the loader for an id it
    lacks, its least recently used id's ``__del__`` awaited past ``capacity``."""

    def __init__(self, load: Callable[[str], Awaitable[Any]], capacity: int):
        self.load, self.capacity, self.models = load, capacity, OrderedDict[str, Any]()

    async def __call__(self, model_id: str) -> Any:
        if model_id in self.models:
            self.models.move_to_end(model_id)
            return self.models[model_id]
        if len(self.models) >= self.capacity:
            _, evicted = self.models.popitem(last=False)
            await evicted.__del__()
        self.models[model_id] = await self.load(model_id)
        return self.models[model_id]


class _Stream:
    """A streaming handle's answer, as the ingress reads it."""

    def __init__(self, items: AsyncIterator[object]):
        self.items = items

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> object:
        return await self.items.__anext__()

    def cancel(self) -> None:
        pass


class _Deployment:
    """Serve's handle to the model's deployment, as the ingress uses it, over the one replica."""

    def __init__(self, replica: ray_replica.VllmReplica):
        self.replica = replica

    def options(self, stream: bool = False, multiplexed_model_id: str = "") -> SimpleNamespace:
        def remote(*arguments: Any) -> _Stream:
            _ROUTED.set(multiplexed_model_id)  # in the ingress's task, which reads the stream
            return _Stream(self.replica.answer(*arguments))

        return SimpleNamespace(answer=SimpleNamespace(remote=remote))


class RayTenants(TenantPool):
    """``TenantPool``'s requests and views, answered by Ray's ingress and replica."""

    def __init__(self, tmp_path: Path, max_adapters: int, monkeypatch: Any):
        super().__init__(tmp_path, replicas=1, max_adapters=max_adapters)  # its store, vLLM and helpers
        monkeypatch.setattr(ray_replica, "_multiplexed_model_id", _ROUTED.get)
        self.client = admin_client(TOKEN, transport=httpx.MockTransport(self.vllm.handler))
        model = _base_model(self.dynamic, max_adapters)
        # The ingress waits this long for the replica to take a request (here at once).
        model = replace(model, autoscaling=replace(model.autoscaling, cold_start_wait_s=10))
        source = AdapterSource(self.store, tmp_path / "ray-cache", self.metrics, model.id)
        replica = object.__new__(ray_replica.VllmReplica)  # no vLLM server started
        replica.model, replica.url, replica.http = model, REPLICA, HttpxPoster(self.client)
        replica.turns, replica.inflight_by_model = BackgroundTurns(), ray_replica.Counter()
        replica.idle = IdleEngine(model, self.client, REPLICA)  # awake: nothing here puts it to sleep
        replica.lora_kernels = {"active": "fineserve", "requested": "fineserve", "mixes_in_kernel": True}
        fair_use = FairUse.of(model.lora, batch_slots(model))
        replica.adapters = ReplicaAdapters(source, self.client, REPLICA, model.lora.max_lora_rank, max_adapters, fair_use)
        replica.adapter = RayCache(
            lambda model_id: replica.adapters.load(model_id, ray_replica._ORGANIZATION.get()),
            max_adapters * ROUTING_MEMORY,
        )
        self.ray_replica = replica
        ingress = object.__new__(Ingress)
        ingress.token, ingress.app_name, ingress.catalog = TOKEN, "tests", Catalog((model,))
        ingress.replicas = {model.id: _Deployment(replica)}
        ingress.sources = {model.id: AdapterSource(self.store, Path("."), Metrics(), model.id)}
        ingress.metrics = AppMetrics()

        async def endpoint(request: Request) -> Response:
            return await ingress(request)

        app = Starlette(routes=[Route("/{path:path}", endpoint, methods=["GET", "POST"])])
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ray", headers=INTERNAL)

    def stop(self) -> None:
        self.ray_replica.adapters.stop()


def tenants_on(backend: str, tmp_path: Path, max_adapters: int, monkeypatch: Any) -> TenantPool:
    """A replica of ``max_adapters`` whose kernel computes mixes, on the embedded pool or Ray Serve."""
    if backend == "ray":
        return RayTenants(tmp_path, max_adapters, monkeypatch)
    return kernel_mixing(TenantPool(tmp_path, replicas=1, max_adapters=max_adapters))
