"""The handler behind the pool's /v1/chat/completions and /v1/completions.

Route the request to a replica (``inference.router``), make that replica hold the adapter
(``inference.adapters``), forward the body unchanged and relay the answer, streamed or not.
A model scaled to zero starts for the request, which waits for it (``Pool.ready_or_start``).
A replica that cannot be reached is taken out of routing and the request tries another; a replica
that lost the adapter (restart, eviction racing this request) gets it again. A request that may
have reached a replica is never sent again (a generation must not run twice): when that replica
fails, the client gets a 503 with Retry-After. Nothing here waits
on anything but the replica: no database, no per-request disk writes; requests and answers go
through ``core.http_client`` (kept-alive connections, a fraction of httpx's cost).

Two kinds of request have their body changed. A fine-tuned model's name is pinned to the revision
the dynamic LoRA path publishes for it now (``<base>:<suffix>@r<N>``, ``core.model_names``): the
engine holds each revision as an adapter of its own, so a stream that started on r1 ends on r1
while r2 loads beside it, and the prefix cache never serves one revision's blocks to another. The
answer names the revision that answered, as OpenAI's name the snapshot behind an alias. A mix
(``adapters``): ``model`` becomes the mix's combined adapter (``inference.adapter_mix``), or stays
the base model when every scale is 0, and ``adapters`` goes (vLLM does not know it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.responses import Response, StreamingResponse

from core import api_errors
from core.catalog import BaseModel, Catalog
from core.http_client import (
    Poster,
    UpstreamBroken,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from core.openai_protocol import RoutedFields, routed_fields, with_fields
from inference.adapter_mix import Mix, requested_scales
from inference.adapters import AdapterManager, ReplicaUnavailable
from inference.background_turns import BACKGROUND_POLL_S
from inference.metrics import CountedRequest, Metrics
from inference.pool import IDLE_STATES, Pool
from inference.replica import Replica
from inference.router import choose_replica
from inference.served_model import served_model

MAX_ATTEMPTS = 3
_JSON = "application/json"
_SSE = "text/event-stream"
# vLLM's own status codes that mean "this replica does not have the adapter" (it restarted, or an
# eviction raced this request): load it again and retry.
_LOST_ADAPTER = 404
_ENGINE_DEAD = b"EngineCore encountered an issue"  # vLLM's EngineDeadError message


class _TryAnother(Exception):
    """This attempt failed in a way another attempt can fix."""

    def __init__(self, failure: api_errors.ApiError, skip_replica: bool):
        self.failure, self.skip_replica = failure, skip_replica


class CompletionsHandler:
    def __init__(self, pool: Pool, catalog: Catalog, adapters: AdapterManager, http: Poster, metrics: Metrics):
        self.pool, self.catalog, self.adapters, self.http, self.metrics = pool, catalog, adapters, http, metrics

    async def handle(
        self, body: bytes, endpoint: str, organization: str | None = None, background: bool = False
    ) -> Response:
        """``organization``: the one the gateway says the request is for (None: not named);
        ``background``: work nobody waits on token by token, which yields to live requests."""
        started = time.perf_counter()
        fields = routed_fields(body)
        base, fine_tuned = served_model(self.catalog, fields.model)
        if fields.adapters is not None:
            request = await self._mix_request(body, endpoint, fields, base, started, organization, background)
        elif fine_tuned:
            pinned, version = await self.adapters.pinned(base.id, fields.model)
            body = body if pinned == fields.model else with_fields(body, model=pinned)
            request = _Request(
                body, endpoint, pinned, base.id, True, fields.stream, started, label_as=fields.model, version=version,
                organization=organization, background=background,
            )
        else:
            request = _Request(body, endpoint, base.id, base.id, False, fields.stream, started, background=background)
        try:
            return await self._forward(request)
        except api_errors.ApiError as exc:
            self._counted(request).finished(exc.status)
            raise

    async def preload(self, model: str) -> tuple[str, int]:
        """Load a just-published adapter on the replica its requests will be routed to, before any
        request names it: its first request finds it loaded. The revision loaded, and on how many
        replicas it is now."""
        base, fine_tuned = served_model(self.catalog, model)
        if not fine_tuned:
            raise api_errors.model_not_found(model)
        pinned, version = await self.adapters.pinned(base.id, model)
        replica = choose_replica(self.pool.ready(base.id), pinned, True)
        if replica is None:
            cold = self.pool.model_states()[base.id]["state"] in IDLE_STATES
            raise api_errors.model_cold(base.id) if cold else api_errors.no_replica(base.id)
        try:
            await self.adapters.ensure(replica, pinned, version)
        except ReplicaUnavailable as exc:
            raise _down(replica, str(exc)).failure from None
        return pinned, sum(1 for replica in self.pool.replicas if replica.adapters.version(pinned) is not None)

    async def _mix_request(
        self,
        body: bytes,
        endpoint: str,
        fields: RoutedFields,
        base: BaseModel,
        started: float,
        organization: str | None,
        background: bool,
    ) -> _Request:
        scales = requested_scales(fields, base.id)
        mix = await self.adapters.mix(base.id, scales) if scales else None  # all scales 0: the base model
        model = mix.name if mix else base.id
        body = with_fields(body, model=model, adapters=None)
        return _Request(
            body, endpoint, model, base.id, mix is not None, fields.stream, started, mix, organization=organization,
            background=background,
        )

    async def _forward(self, request: _Request) -> Response:
        skip: set[Replica] = set()
        failure = api_errors.no_replica(request.base_id)
        if request.version is not None and not self.pool.ready(request.base_id):
            self.adapters.prefetch(request.base_id, request.model, request.version)  # while a replica starts
        await self.pool.ready_or_start(request.base_id)  # a cold model starts, and the request waits for it
        for _ in range(MAX_ATTEMPTS):
            candidates = [replica for replica in self.pool.ready(request.base_id) if replica not in skip]
            replica = choose_replica(candidates, request.model, request.adapter)
            if replica is None:
                raise api_errors.no_replica(request.base_id)
            try:
                return await self._attempt(replica, request)
            except _TryAnother as retry:
                failure = retry.failure
                if retry.skip_replica:
                    skip.add(replica)
        raise failure

    async def _attempt(self, replica: Replica, request: _Request) -> Response:
        model = request.model
        await self._turn(replica, request)
        done = _Done(replica, model, request.background)
        try:
            if request.mix is not None:  # a kernel mix's parts are in use as each is ensured
                await self.adapters.ensure_mix(replica, request.mix, request.organization, done.uses)
            elif request.adapter:
                await self.adapters.ensure(replica, model, request.version, request.organization)
        except ReplicaUnavailable as exc:
            done()
            raise _down(replica, str(exc)) from None
        except BaseException:
            done()
            raise
        # From here on the engine may be answering with this adapter: it must not be unloaded.
        if request.adapter:
            done.uses(model)
        try:
            upstream = await self.http.post(f"{replica.url}/v1/{request.endpoint}", request.body)
        except UpstreamUnavailable as exc:
            done()
            raise _down(replica, str(exc)) from None
        except UpstreamBroken as exc:
            done()
            replica.mark_down(str(exc))
            raise api_errors.replica_lost(str(exc)) from None
        except UpstreamTimeout as exc:
            done()
            raise api_errors.replica_failed(str(exc)) from None
        except BaseException:
            done()
            raise
        if upstream.status == _LOST_ADAPTER and request.adapter:
            upstream.close()
            done()
            replica.adapters.forget(model)  # the next attempt loads it again
            raise _TryAnother(api_errors.replica_failed(f"{replica.url} does not keep `{model}` loaded"), False)
        if request.stream and upstream.status < 400:
            return StreamingResponse(
                self._relay(upstream, done, request),
                status_code=upstream.status,
                media_type=upstream.headers.get("content-type", _SSE),
                headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
            )
        return await self._whole(upstream, done, request)

    async def _turn(self, replica: Replica, request: _Request) -> None:
        """Return when the request may start on the replica: its organization's turn in the batch slots
        (an adapter's), and background work's turn beside live requests. Both are checked last
        without a yield in between, and the caller begins the request before it yields."""
        waited = False
        while True:
            if request.adapter:
                await self.adapters.batch_turn(replica, request.model, request.organization, request.mix)
            if replica.turns.may_start(request.background):
                return
            if not waited:
                self.metrics.background_waits.labels(request.base_id).inc()
                waited = True
            await asyncio.sleep(BACKGROUND_POLL_S)

    async def _whole(self, upstream: UpstreamResponse, done: _Done, request: _Request) -> Response:
        try:
            raw = await upstream.read()
        except UpstreamError as exc:
            done.replica.mark_down(str(exc))
            raise api_errors.replica_lost(str(exc)) from None
        finally:
            done()
        if upstream.status >= 500 and _ENGINE_DEAD in raw:
            # Its engine process died; the server answers until it notices and exits.
            raise _down(done.replica, "its engine died")
        if upstream.status >= 400:
            raise api_errors.from_replica(upstream.status, raw)
        self._counted(request).finished(upstream.status, whole=True)
        return Response(raw, status_code=upstream.status, media_type=_JSON)

    async def _relay(self, upstream: UpstreamResponse, done: _Done, request: _Request) -> AsyncIterator[bytes]:
        status, first, counted = upstream.status, True, self._counted(request)
        try:
            async for chunk in upstream.iter_body():
                if first:
                    counted.first_byte()
                    first = False
                yield chunk
        except UpstreamError as exc:
            # The headers are sent already: the error travels as one more event, as vLLM does it.
            done.replica.mark_down(str(exc))
            status = 502
            yield b"data: " + json.dumps(api_errors.replica_failed(str(exc)).body()).encode() + b"\n\n"
        finally:
            upstream.close()  # a client that went away: the replica sees the connection drop and stops
            done()
            counted.finished(status)

    def _counted(self, request: _Request) -> CountedRequest:
        return CountedRequest(self.metrics, request.label, request.endpoint, request.started)


@dataclass(frozen=True)
class _Request:
    body: bytes
    endpoint: str  # "chat/completions" or "completions"
    model: str  # the full name: the adapter's name in vLLM too
    base_id: str
    adapter: bool
    stream: bool
    started: float
    mix: Mix | None = None
    label_as: str | None = None  # the name the client asked for, when the pool pinned it
    version: str | None = None  # the pinned revision's, as the store published it
    organization: str | None = None  # whose adapter it is, for fair use of the replica's slots
    background: bool = False  # yields to live requests (``BackgroundTurns.may_start``)

    @property
    def label(self) -> str:
        """The model in metrics: mixes as one, since each has a name of its own; a revision as its model."""
        return f"{self.base_id}:mix" if self.mix else self.label_as or self.model


def _down(replica: Replica, reason: str) -> _TryAnother:
    replica.mark_down(reason)
    return _TryAnother(api_errors.no_replica(replica.model.id), skip_replica=True)


class _Done:
    """Begins one request's accounting on its replica, and ends it once, however the request ends."""

    def __init__(self, replica: Replica, model: str, background: bool):
        self.replica, self.model, self.background, self.called = replica, model, background, False
        self.adapters: list[str] = []
        replica.begin(model, background)

    def uses(self, adapter: str) -> None:
        """The engine answers this request with ``adapter`` (its own, or a kernel mix's part): it
        is not unloaded until the request ends."""
        self.adapters.append(adapter)
        self.replica.adapters.started(adapter)

    def __call__(self) -> None:
        if self.called:
            return
        self.called = True
        self.replica.end(self.model, self.background)
        for adapter in self.adapters:
            self.replica.adapters.finished(adapter)
