"""The pool: the replicas of every catalog model, kept running and probed for health."""

from __future__ import annotations

import asyncio
import time

import httpx

from core.catalog import Catalog
from inference.periodic import every
from inference.replica import Replica, replicas_for

SUPERVISE_INTERVAL_S = 1.0


class Pool:
    def __init__(self, catalog: Catalog, first_replica_port: int, internal_token: str):
        self.catalog = catalog
        self.replicas: list[Replica] = []
        port = first_replica_port
        for model in catalog.models:
            self.replicas += replicas_for(model, port, internal_token)
            port += model.replicas

    def ready(self, model_id: str | None = None) -> list[Replica]:
        return [r for r in self.replicas if r.healthy and (model_id is None or r.model.id == model_id)]

    async def supervise_forever(self, client: httpx.AsyncClient) -> None:
        """Start what is not running and probe every replica, each second, whatever goes wrong."""
        await every(SUPERVISE_INTERVAL_S, lambda: self.supervise_once(client), "supervising the replicas")

    async def supervise_once(self, client: httpx.AsyncClient) -> None:
        now = time.monotonic()
        for replica in self.replicas:
            replica.supervise(now)
        await asyncio.gather(*(replica.probe(client) for replica in self.replicas))

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()

    def health(self) -> dict:
        ready = self.ready()
        return {
            "ready_replicas": len(ready),
            "detail": "ok" if ready else "no replica is ready yet (vLLM takes about a minute to start on a CPU)",
            "replicas": [replica.status() for replica in self.replicas],
        }
