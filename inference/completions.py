"""The handler behind the pool's /v1/chat/completions and /v1/completions.

Route the request to a replica (``inference.router``), make that replica hold the adapter
(``inference.adapters``), forward the body unchanged and relay the answer, streamed or not.
A replica that does not answer is taken out of routing and the request tries another; a replica
that lost the adapter (restart, eviction racing this request) gets it again. Nothing here waits
on anything but the replica: no database, no per-request disk writes; requests and answers go
through ``inference.http_client`` (kept-alive connections, a fraction of httpx's cost).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator

from starlette.responses import Response, StreamingResponse

from core.catalog import Catalog
from core.model_names import is_valid_suffix, parse_model_name
from inference import errors
from inference.adapters import AdapterManager, ReplicaUnavailable
from inference.http_client import Poster, UpstreamBroken, UpstreamError, UpstreamTimeout, UpstreamUnavailable
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
_ENGINE_DEAD = b"EngineCore encountered an issue"  # vLLM's EngineDeadError message


class CompletionsHandler:
    def __init__(self, pool: Pool, catalog: Catalog, adapters: AdapterManager, http: Poster, metrics: Metrics):
        self.pool, self.catalog, self.adapters, self.http, self.metrics = pool, catalog, adapters, http, metrics

    async def handle(self, body: bytes, endpoint: str) -> Response:
        started = time.perf_counter()
        fields = routed_fields(body)
        name = parse_model_name(fields.model)
        base = self.catalog.get(name.base_model_id)
        if base is None or (name.suffix is not None and not is_valid_suffix(name.suffix)):
            raise errors.model_not_found(fields.model)
        model = str(name)
        try:
            return await self._forward(body, endpoint, model, base.id, name.suffix is not None, fields.stream, started)
        except errors.ApiError as exc:
            self._count(model, endpoint, exc.status, started)
            raise

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
            except ReplicaUnavailable as exc:
                replica.end(model)
                replica.mark_down(str(exc))
                skip.add(replica)
                continue
            except BaseException:
                replica.end(model)
                raise
            # From here the engine may be answering with this adapter: it must not be unloaded.
            done = _Done(replica, model, adapter)
            try:
                upstream = await self.http.post(f"{replica.url}/v1/{endpoint}", body)
            except (UpstreamUnavailable, UpstreamBroken) as exc:
                done()
                replica.mark_down(str(exc))
                skip.add(replica)
                continue
            except UpstreamTimeout as exc:
                done()
                raise errors.replica_failed(str(exc)) from None
            except BaseException:
                done()
                raise
            if upstream.status == _LOST_ADAPTER and adapter:
                upstream.close()
                done()
                replica.adapters.forget(model)
                failure = errors.replica_failed(f"{replica.url} does not keep `{model}` loaded")
                continue
            if upstream.status >= 400 or not stream:
                try:
                    raw = await upstream.read()
                except UpstreamError as exc:
                    replica.mark_down(str(exc))
                    raise errors.replica_failed(str(exc)) from None
                finally:
                    done()
                if upstream.status >= 500 and _ENGINE_DEAD in raw:
                    # Its engine process died; the server answers until it notices: try another.
                    replica.mark_down("its engine died")
                    skip.add(replica)
                    failure = errors.replica_failed(f"the engine of {replica.url} died; it is being restarted")
                    continue
                if upstream.status >= 400:
                    raise errors.from_replica(upstream.status, raw)
                self._count(model, endpoint, upstream.status, started, first_byte=True)
                return Response(raw, status_code=upstream.status, media_type=_JSON)
            return StreamingResponse(
                self._relay(upstream, done, model, endpoint, started),
                status_code=upstream.status,
                media_type=upstream.headers.get("content-type", _SSE),
                headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
            )
        raise failure

    async def _relay(self, upstream, done: _Done, model: str, endpoint: str, started: float) -> AsyncIterator[bytes]:
        status, first = upstream.status, True
        try:
            async for chunk in upstream.iter_body():
                if first:
                    self.metrics.first_byte.labels(model, endpoint).observe(time.perf_counter() - started)
                    first = False
                yield chunk
        except UpstreamError as exc:
            # The headers are sent already: the error travels as one more event, as vLLM does it.
            done.replica.mark_down(str(exc))
            status = 502
            yield b"data: " + json.dumps(errors.replica_failed(str(exc)).body()).encode() + b"\n\n"
        finally:
            upstream.close()  # a client that went away: the replica sees the connection drop and stops
            done()
            self._count(model, endpoint, status, started)

    def _count(self, model: str, endpoint: str, status: int, started: float, first_byte: bool = False) -> None:
        elapsed = time.perf_counter() - started
        self.metrics.requests.labels(model, endpoint, str(status)).inc()
        if status < 400:
            self.metrics.latency.labels(model, endpoint).observe(elapsed)
            if first_byte:
                self.metrics.first_byte.labels(model, endpoint).observe(elapsed)


class _Done:
    """Ends one request's accounting on its replica, once, however the request ends."""

    def __init__(self, replica: Replica, model: str, adapter: bool):
        self.replica, self.model, self.adapter, self.called = replica, model, adapter, False
        if adapter:
            replica.adapters.started(model)

    def __call__(self) -> None:
        if self.called:
            return
        self.called = True
        self.replica.end(self.model)
        if self.adapter:
            self.replica.adapters.finished(self.model)
