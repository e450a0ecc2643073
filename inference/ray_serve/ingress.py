"""The Ray Serve application's HTTP entry point, in front of every Ray-backed model's replicas.

The gateway sends it what it sends the embedded pool, with the internal token, and gets the same
answers: the same routes, the same errors, a stream stays a stream. What it does itself:

- refuse a caller without the internal token (401);
- pin a fine-tuned model's name to the revision the dynamic LoRA path publishes now
  (``<base>:<suffix>@rN``, as the pool does), and make that, with the publish it answers with, the
  request's multiplexed model id (``replica_adapters.routing_id``), so Ray routes it to a replica
  that holds that very publish and a stream stays on its revision;
- wait for a model scaled to zero up to its ``cold_start_wait_s``, then answer 503 with
  Retry-After (Ray holds the request meanwhile and starts a replica for it);
- ``GET /health``: each model's state from Serve's own status ("ready" on N replicas,
  "starting", "cold"), and "asleep" when each running replica says its engine sleeps, in the
  pool's shape;
- ``GET /metrics``: the pool's series for its models: requests and latency it counts itself, adapter
  loads, evictions and held adapters as its replicas report them (``app_metrics``).

A mix (``adapters``) is pinned here to its parts' published versions (``adapter_mix.published_mix``)
and routed by its first part's id, so Ray prefers a replica that holds that part; the replica
computes it in its kernel, as the pool's replicas do.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray.exceptions import RayActorError, RayError
from ray.serve.exceptions import RayServeException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from core import api_errors, strict_json
from core.adapter_store import store_of
from core.catalog import BaseModel, Catalog
from core.config import load_config
from core.internal_token import presents
from core.model_names import pinned_name
from core.openai_protocol import BACKGROUND_HEADER, ORGANIZATION_HEADER, routed_fields, with_fields
from inference.adapter_mix import Mix, published_mix, requested_scales
from inference.adapter_source import AdapterSource
from inference.metrics import CONTENT_TYPE, CountedRequest, Metrics
from inference.pool import COLD_START_RETRY_AFTER_S
from inference.ray_serve.app_metrics import AppMetrics, ReplicaReport
from inference.ray_serve.replica import STARTED, Head
from inference.ray_serve.replica_adapters import routing_id
from inference.served_model import served_model

_ATTEMPTS = 3  # replicas a request may be offered to when the first ones die before taking it
_REPORT_TIMEOUT_S = 1.0  # for the replicas' metrics: the platform gives a scrape 2 s
_COMPLETIONS = {"/v1/chat/completions": "chat/completions", "/v1/completions": "completions"}


@dataclass(frozen=True)
class Turn:
    """What decides when a request starts on its replica, from the gateway's marks."""

    background: bool  # nobody reads it token by token: it yields to live requests
    organization: str | None  # whose it is, for its share of the batch slots (None: not held back)


def deployment_name(model_id: str) -> str:
    """A Serve deployment's name for a catalog model (Serve names take no slashes)."""
    return "vllm-" + re.sub(r"[^A-Za-z0-9_.-]", "--", model_id)


class Ingress:
    def __init__(self, replicas: dict[str, Any], models: tuple[BaseModel, ...], app_name: str):
        """``replicas``: each model's deployment handle, by model id."""
        config = load_config()
        self.token = config.internal_token
        self.replicas, self.app_name = replicas, app_name
        self.catalog = Catalog(models)
        self.sources = {  # for "which revision is published now?" only: nothing is downloaded here
            model.id: AdapterSource(store_of(model, config.s3), Path("."), Metrics(), model.id) for model in models
        }
        self.metrics = AppMetrics()

    async def __call__(self, request: Request) -> Response:
        if not presents(request.headers.get("authorization"), self.token):
            return _error(api_errors.internal_token_required("INTERNAL_TOKEN", "authorization" in request.headers))
        path = request.url.path
        try:
            if path in _COMPLETIONS and request.method == "POST":
                # Background work yields to live requests, and an organization has its share of a
                # replica's batch slots, on the replica (the gateway marks both, as for the pool).
                turn = Turn(BACKGROUND_HEADER in request.headers, request.headers.get(ORGANIZATION_HEADER))
                return await self._complete(await request.body(), _COMPLETIONS[path], turn)
            if path == "/v1/adapters/preload" and request.method == "POST":
                return await self._preload(await request.body())
            if path == "/health":
                return JSONResponse(await self._health())
            if path == "/metrics":
                return Response(await self._metrics(), media_type=CONTENT_TYPE)
            return _error(api_errors.ApiError(f"No route {request.method} {path}.", status=404, code="not_found"))
        except api_errors.ApiError as exc:
            return _error(exc)

    async def _pinned(self, base: BaseModel, model: str) -> tuple[str, str]:
        """The name vLLM answers ``model`` under now (pinned to its revision), and the multiplexed
        model id Ray routes it by (that name at the publish the store has now)."""
        found = await self.sources[base.id].version(model)
        if found is None:
            raise api_errors.adapter_not_found(model)
        pinned = pinned_name(model, found.version)
        return pinned, routing_id(pinned, found.identity)

    async def _complete(self, body: bytes, endpoint: str, turn: Turn) -> Response:
        started = time.perf_counter()
        fields = routed_fields(body)
        base, fine_tuned = served_model(self.catalog, fields.model)
        routed_as, mix, label = "", None, fields.model if fine_tuned else base.id
        if fields.adapters is not None:
            scales = requested_scales(fields, base.id)
            mix = await published_mix(self.sources[base.id], base.id, scales) if scales else None  # all 0: the base
            body = with_fields(body, model=mix.name if mix else base.id, adapters=None)
            if mix is not None:
                first = mix.parts[0]
                routed_as, label = routing_id(first.pinned, first.version), f"{base.id}:mix"
        elif fine_tuned:
            adapter, routed_as = await self._pinned(base, fields.model)
            body = body if adapter == fields.model else with_fields(body, model=adapter)
        request = CountedRequest(self.metrics.ingress, label, endpoint, started)
        try:
            return await self._answer(base, routed_as, body, fields.stream, request, turn, mix)
        except api_errors.ApiError as exc:
            request.finished(exc.status)
            raise

    async def _answer(
        self, base: BaseModel, routed_as: str, body: bytes, stream: bool, request: CountedRequest, turn: Turn,
        mix: Mix | None,
    ) -> Response:
        answer = await self._taken(base, routed_as, request.endpoint, body, turn, mix)
        try:
            head: Head = await answer.__anext__()
            if stream and head.status < 400:
                return StreamingResponse(
                    _rest(answer, request, head.status), status_code=head.status, media_type=head.content_type,
                    headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
                )
            raw = b"".join([chunk async for chunk in answer])
        except RayActorError as exc:  # it died with the request: never sent again (it may have run)
            raise api_errors.replica_lost(f"Ray: {type(exc).__name__}") from None
        except RayError as exc:
            raise api_errors.replica_failed(str(exc).splitlines()[0]) from None
        if head.status >= 400 and api_errors.made_by_vllm(raw):  # its words reach the tenant scrubbed, as the pool's do
            raise api_errors.from_replica(head.status, raw)
        request.finished(head.status, whole=True)
        return Response(raw, status_code=head.status, media_type=head.content_type)

    async def _taken(
        self, base: BaseModel, routed_as: str, endpoint: str, body: bytes, turn: Turn, mix: Mix | None
    ) -> Any:
        """The request's answer stream, once a replica has taken the request. It waits while none
        can (scaled to zero, or all full), up to the model's ``cold_start_wait_s``; a replica that
        dies before it takes the request (a node lost) is replaced by another."""
        handle = self.replicas[base.id].options(stream=True, multiplexed_model_id=routed_as)
        for _ in range(_ATTEMPTS):
            answer = handle.answer.remote(endpoint, body, turn.background, turn.organization, mix)
            try:
                item = await asyncio.wait_for(answer.__anext__(), base.autoscaling.cold_start_wait_s)
            except TimeoutError:
                answer.cancel()
                raise api_errors.model_starting(base.id, COLD_START_RETRY_AFTER_S) from None
            except RayActorError:
                continue
            assert item == STARTED
            return answer
        raise api_errors.no_replica(base.id)

    async def _preload(self, body: bytes) -> Response:
        try:
            model = str(strict_json.loads(body)["model"])
        except (ValueError, KeyError, TypeError):
            raise api_errors.ApiError(
                'The body must be {"model": "<base_model_id>:<suffix>"}.', param="model"
            ) from None
        base, fine_tuned = served_model(self.catalog, model)
        if not fine_tuned:
            raise api_errors.model_not_found(model)
        pinned, routed_as = await self._pinned(base, model)
        await self.replicas[base.id].options(multiplexed_model_id=routed_as).preload.remote()
        return JSONResponse({"model": pinned, "replicas": 1})

    async def _replica_states(self) -> dict[str, dict[str, int]]:
        """Each model's replicas by state ("RUNNING", "STARTING", ...), as Serve's status counts them."""
        from ray import serve

        status = await asyncio.to_thread(serve.status)
        deployments = status.applications[self.app_name].deployments
        # Serve's ReplicaState is a str enum: its counts read by the states' names.
        return {
            model_id: {
                str(getattr(state, "value", state)): count
                for state, count in deployments[deployment_name(model_id)].replica_states.items()
            }
            for model_id in self.catalog.ids
        }

    async def _health(self) -> dict:
        models, replicas = {}, []
        for model_id, states in (await self._replica_states()).items():
            running = states.get("RUNNING", 0)
            asleep = running and await self._all_asleep(model_id, running)
            ready = 0 if asleep else running
            starting = states.get("STARTING", 0)
            models[model_id] = {
                "state": "ready" if ready else "asleep" if asleep else "starting" if starting else "cold",
                "ready_replicas": ready,
            }
            replicas += [{"model": model_id, "healthy": True, "adapters": []}] * ready
        return {"serving": True, "models": models, "replicas": replicas, "backend": "ray"}

    async def _metrics(self) -> bytes:
        """The ingress's counts, and what each model's running replicas report now (asked all at once)."""
        running = {model_id: states.get("RUNNING", 0) for model_id, states in (await self._replica_states()).items()}
        answers = await asyncio.gather(*(self._reports(model_id, count) for model_id, count in running.items()))
        for (model_id, count), reports in zip(running.items(), answers):
            self.metrics.heard(model_id, reports, everyone=len(reports) == count)
        return self.metrics.render(report for reports in answers for report in reports)

    async def _all_asleep(self, model_id: str, running: int) -> bool:
        """Whether each of the model's running replicas said its engine sleeps (a model scaled to zero
        that keeps its process): the next request wakes one. Nobody is asked for a model that never sleeps."""
        model = self.catalog.get(model_id)
        if model is None or not model.autoscaling.keeps_one_asleep:
            return False
        reports = await self._reports(model_id, running)
        return len(reports) == running and all(report.asleep for report in reports)

    async def _reports(self, model_id: str, running: int) -> list[ReplicaReport]:
        """The reports of the model's replicas that answered in time (at once, busy or not: a report
        is read from memory, and the engine generates in a process of its own)."""
        if not running:
            return []  # nobody to ask: a broadcast would wait for a replica
        try:
            answers = (
                await self.replicas[model_id]
                .broadcast("metrics_report")
                .results_async(timeout_s=_REPORT_TIMEOUT_S, return_exceptions=True)
            )
        except (RayError, RayServeException, TimeoutError):
            return []
        return [answer for answer in answers if isinstance(answer, ReplicaReport)]


async def _rest(answer: Any, request: CountedRequest, status: int) -> AsyncIterator[bytes]:
    first = True
    try:
        async for chunk in answer:
            if first:
                request.first_byte()
                first = False
            yield chunk
    except RayError as exc:  # the headers are sent: the error travels as one more event, as vLLM does it
        status = 502
        yield b"data: " + api_errors.replica_failed(f"Ray: {type(exc).__name__}").json_bytes() + b"\n\n"
    finally:
        answer.cancel()  # a caller that went away: the replica stops relaying, and vLLM generating
        request.finished(status)


def _error(error: api_errors.ApiError) -> Response:
    return Response(error.json_bytes(), error.status, error.headers(), media_type="application/json")
