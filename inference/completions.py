"""The handler behind the pool's /v1/chat/completions and /v1/completions.

Route the request to a replica (``inference.router``), make that replica hold the adapter
(``inference.adapters``), forward the body unchanged and relay the answer, streamed or not.
A replica that does not answer is taken out of routing and the request tries another; a replica
that lost the adapter (restart, eviction racing this request) gets it again. Nothing here waits
on anything but the replica: no database, no per-request disk writes.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator

import httpx
from starlette.responses import Response, StreamingResponse

from core.catalog import Catalog
from core.model_names import is_valid_suffix, parse_model_name
from inference import errors
from inference.adapters import AdapterManager, ReplicaUnavailable
from inference.metrics import Metrics
from inference.pool import Pool
from inference.protocol import routed_fields
from inference.replica import Replica
from inference.router import choose_replica

log = logging.getLogger("inference.completions")

MAX_ATTEMPTS = 3
_JSON = "application/json"
_SSE = "text/event-stream"
# vLLM's own status codes that mean "this replica does not have the adapter" (it restarted, or an
# eviction raced this request): load it again and retry.
_LOST_ADAPTER = 404


class CompletionsHandler:
    def __init__(self, pool: Pool, catalog: Catalog, adapters: AdapterManager, client: httpx.AsyncClient, metrics: Metrics):
        self.pool, self.catalog, self.adapters, self.client, self.metrics = pool, catalog, adapters, client, metrics

    async def handle(self, body: bytes, endpoint: str) -> Response:
        started = time.perf_counter()
        fields = routed_fields(body)
        name = parse_model_name(fields.model)
        base = self.catalog.get(name.base_model_id)
        if base is None or (name.suffix is not None and not is_valid_suffix(name.suffix)):
            raise errors.model_not_found(fields.model)
        model = str(name)
        try:
            response = await self._forward(body, endpoint, model, base.id, name.suffix is not None, fields.stream, started)
        except errors.ApiError as exc:
            self._count(model, endpoint, exc.status, started)
            raise
        return response

    async def _forward(
        self, body: bytes, endpoint: str, model: str, base_id: str, adapter: bool, stream: bool, started: float
    ) -> Response:
        skip: set[Replica] = set()
        failure = errors.no_replica(base_id)
        for _ in range(MAX_ATTEMPTS):
            candidates = [replica for replica in self.pool.ready(base_id) if replica not in skip]
            replica = choose_replica(candidates, model, adapter)
            if replica is None:
                raise errors.no_replica(base_id)
            replica.begin(model)
            try:
                if adapter:
                    await self.adapters.ensure(replica, model)
                upstream = await self.client.send(
                    self.client.build_request(
                        "POST", f"{replica.url}/v1/{endpoint}", content=body, headers={"content-type": _JSON}
                    ),
                    stream=True,
                )
            except (ReplicaUnavailable, httpx.TransportError) as exc:
                replica.end(model)
                if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
                    raise errors.replica_failed(f"no answer in time ({exc!r})") from None
                replica.mark_down(repr(exc))
                skip.add(replica)
                continue
            except BaseException:
                replica.end(model)
                raise
            if upstream.status_code == _LOST_ADAPTER and adapter:
                await upstream.aclose()
                replica.end(model)
                replica.adapters.forget(model)
                failure = errors.replica_failed(f"{replica.url} does not keep `{model}` loaded")
                continue
            if upstream.status_code >= 400:
                raw = await _read_and_close(upstream)
                replica.end(model)
                raise errors.from_replica(upstream.status_code, raw)
            if stream:
                return StreamingResponse(
                    self._relay(upstream, replica, model, endpoint, started),
                    status_code=upstream.status_code,
                    media_type=_SSE,
                    headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
                )
            try:
                raw = await _read_and_close(upstream)
            except httpx.TransportError as exc:
                replica.mark_down(repr(exc))
                raise errors.replica_failed(repr(exc)) from None
            finally:
                replica.end(model)
            self._count(model, endpoint, upstream.status_code, started, first_byte=True)
            return Response(raw, status_code=upstream.status_code, media_type=_JSON)
        raise failure

    async def _relay(
        self, upstream: httpx.Response, replica: Replica, model: str, endpoint: str, started: float
    ) -> AsyncIterator[bytes]:
        status, first = upstream.status_code, True
        try:
            async for chunk in upstream.aiter_raw():
                if first:
                    self.metrics.first_byte.labels(model, endpoint).observe(time.perf_counter() - started)
                    first = False
                yield chunk
        except httpx.TransportError as exc:
            # Headers are gone already: the error travels as one more event, as vLLM does it.
            replica.mark_down(repr(exc))
            status = 502
            yield b"data: " + json.dumps(errors.replica_failed(repr(exc)).body()).encode() + b"\n\n"
        finally:
            await upstream.aclose()
            replica.end(model)
            self._count(model, endpoint, status, started)

    def _count(self, model: str, endpoint: str, status: int, started: float, first_byte: bool = False) -> None:
        elapsed = time.perf_counter() - started
        self.metrics.requests.labels(model, endpoint, str(status)).inc()
        if status < 400:
            self.metrics.latency.labels(model, endpoint).observe(elapsed)
            if first_byte:
                self.metrics.first_byte.labels(model, endpoint).observe(elapsed)


async def _read_and_close(upstream: httpx.Response) -> bytes:
    try:
        return await upstream.aread()
    finally:
        await upstream.aclose()
