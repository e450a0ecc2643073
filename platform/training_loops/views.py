"""``/api/v1/...``: the Tinker protocol's routes, as the official ``tinker`` SDK calls them. Views
parse, call one function of ``training_loops.runs`` / ``.sampling`` / ``.futures``, and shape.

The SDK authenticates with ``X-API-Key``; it insists on a ``tml-`` prefix, so a platform key is
given as ``tml-<key>`` (the dashboard's API keys page shows that form too). Work on a run is
queued for its trainer and answered through ``retrieve_future``, in the order it came.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from accounts.models import Organization
from base.api_views import parsed
from base.error_responses import api_error
from core import api_errors, strict_json, tinker_wire
from gateway.access import authorize
from training_loops import futures, runs
from training_loops.futures import FORWARD_BACKWARD, SAMPLE
from training_loops.requests import (
    CreateModel, CreateSamplingSession, CreateSession, LoadWeights, ModelRef, OptimStep, Publish, RetrieveFuture,
    SaveWeights, SaveWeightsForSampler, SessionHeartbeat,
)
from training_loops.samplers import Sampler, open_sampler_async, sampler_of
from training_loops.sampling import SampleCall, sample

TINKER_KEY_PREFIX = "tml-"
_background: set[asyncio.Task] = set()  # samples under way: the loop holds tasks only weakly

Handler = Callable[..., Awaitable[Any]]  # (request, organization, **the path's parts)
View = Callable[..., Coroutine[Any, Any, HttpResponse]]


def tinker_route(method: str = "POST") -> Callable[[Handler], View]:
    """A view of the protocol: the caller's key checked, its errors in the API's shape, a dict
    returned as JSON."""

    def wrap(handler: Handler) -> View:
        @csrf_exempt
        async def view(request: HttpRequest, **kwargs: str) -> HttpResponse:
            try:
                if request.method != method:
                    raise api_errors.method_not_allowed(method)
                organization = await _organization(request.headers.get("X-API-Key") or "")
                answer = await handler(request, organization, **kwargs)
                return answer if isinstance(answer, HttpResponse) else JsonResponse(answer)
            except api_errors.ApiError as exc:
                return api_error(exc)

        view.__name__ = handler.__name__
        return view

    return wrap


async def _organization(key: str) -> Organization:
    access = await authorize(key.removeprefix(TINKER_KEY_PREFIX), None)
    return await sync_to_async(lambda: access.api_key.organization)()


def _json(request: HttpRequest) -> Any:
    return api_errors.object_body(strict_json.body(request.body))


def _sync(function: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    return sync_to_async(function, thread_sensitive=True)


@csrf_exempt
async def healthz(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"status": "ok"})


@csrf_exempt
async def client_config(request: HttpRequest) -> HttpResponse:
    """The SDK's feature flags for this server: API keys (no JWT exchange), uncompressed bodies,
    one future polled at a time (no ``retrieve_futures``), losses computed by the server."""
    return JsonResponse({
        "pjwt_auth_enabled": False, "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
        "custom_loss_server_side": False, "sample_join_sampling_session": False, "use_pyqwest_transport": False,
        "parallel_fwdbwd_chunks": False,
    })


@csrf_exempt
async def telemetry(request: HttpRequest) -> HttpResponse:
    """The SDK reports its own events; this server keeps none of them (its own logs say what it did)."""
    return JsonResponse({"status": "accepted"})


@tinker_route("GET")
async def server_capabilities(request: HttpRequest, organization: Organization) -> dict:
    return {"supported_models": runs.capabilities()}


@tinker_route()
async def create_session(request: HttpRequest, organization: Organization) -> dict:
    body = parsed(CreateSession, _json(request))
    session = await _sync(runs.create_session)(organization, body.tags, body.user_metadata, body.sdk_version, body.display_name or "")
    return {"type": "create_session", "session_id": session.pk}


@tinker_route()
async def session_heartbeat(request: HttpRequest, organization: Organization) -> dict:
    body = parsed(SessionHeartbeat, _json(request))
    await _sync(runs.beat)(organization, body.session_id)
    return {"type": "session_heartbeat"}


@tinker_route()
async def finish_session(request: HttpRequest, organization: Organization, session_id: str) -> dict:
    await _sync(runs.finish)(organization, session_id)
    return {}


@tinker_route()
async def create_model(request: HttpRequest, organization: Organization) -> dict:
    body = parsed(CreateModel, _json(request))
    if body.lora_config is None:
        raise api_errors.ApiError("lora_config is required: this server trains LoRA adapters only", param="lora_config")
    shape = runs.RunShape(body.model_seq_id, body.base_model, body.lora_config.rank, body.lora_config.seed, body.lora_config.train_mlp,
                          body.lora_config.train_attn, body.user_metadata)
    run = await _sync(runs.create_run)(organization, body.session_id, shape)
    request_id = await futures.done_at_once(organization.pk, {"type": "create_model", "model_id": run.pk})
    return {"request_id": request_id, "model_id": run.pk}


@tinker_route()
async def get_info(request: HttpRequest, organization: Organization) -> dict:
    body = parsed(ModelRef, _json(request))
    run = await _sync(runs.run_of)(organization, body.model_id)
    return {
        "type": "get_info", "model_id": run.pk, "is_lora": True, "lora_rank": run.lora_rank, "model_name": run.base_model,
        "model_data": {"arch": "causal_lm", "model_name": run.base_model, "tokenizer_id": runs.tokenizer_id(run.base_model)},
    }


async def _queue(organization: Organization, model_id: str, operation: dict) -> dict:
    run = await _sync(runs.open_run_of)(organization, model_id)
    request_id = await futures.accept(organization.pk, run.pk, operation)
    return {"request_id": request_id, "model_id": run.pk}


@tinker_route()
async def forward_backward(request: HttpRequest, organization: Organization) -> dict:
    try:
        call = tinker_wire.forward_backward_call(tinker_wire.inflated(request.body, request.headers.get("Content-Encoding", "")))
    except tinker_wire.WireError as exc:
        raise api_errors.ApiError(f"forward_backward: {exc}", param="forward_backward_input") from None
    operation = {
        "op": "forward_backward", "loss_fn": call.loss_fn, "loss_fn_config": call.loss_fn_config, "forward_only": call.forward_only,
        "data": [{"tokens": datum.tokens, "inputs": datum.inputs} for datum in call.data],
    }
    return await _queue(organization, call.model_id, operation)


@tinker_route()
async def optim_step(request: HttpRequest, organization: Organization) -> dict:
    body = parsed(OptimStep, _json(request))
    return await _queue(organization, body.model_id, {"op": "optim_step", "adam": body.adam_params.model_dump()})


@tinker_route()
async def save_weights(request: HttpRequest, organization: Organization) -> dict:
    body = parsed(SaveWeights, _json(request))
    name = runs.checked_name(body.path)
    return await _queue(organization, body.model_id, {"op": "save_state", "name": name})


@tinker_route()
async def save_weights_for_sampler(request: HttpRequest, organization: Organization) -> dict:
    body = parsed(SaveWeightsForSampler, _json(request))
    name = runs.checked_name(body.path)
    return await _queue(organization, body.model_id, {"op": "save_sampler", "name": name, "open_sampler": name is None})


@tinker_route()
async def load_weights(request: HttpRequest, organization: Organization) -> dict:
    """Into a run (``model_id``), or as a new run's first request (``session_id``): a run created
    from a saved state, its rank and targets the state's."""
    body = parsed(LoadWeights, _json(request))
    checkpoint = await _sync(runs.checkpoint_at)(organization, body.path)
    if body.model_id is not None:
        operation = {"op": "load_state", "checkpoint": checkpoint.pk, "with_optimizer": body.optimizer}
        return await _queue(organization, body.model_id, operation)
    if body.session_id is None:
        raise api_errors.ApiError("give model_id (load into a run) or session_id (a new run from the state)", param="model_id")
    run = await _sync(runs.run_from_state)(organization, body.session_id, body.model_seq_id, checkpoint, body.optimizer, body.user_metadata)
    request_id = await futures.done_at_once(organization.pk, {"type": "load_weights", "path": checkpoint.path, "model_id": run.pk})
    return {"request_id": request_id, "model_id": run.pk}


@tinker_route()
async def create_sampling_session(request: HttpRequest, organization: Organization) -> dict:
    body = parsed(CreateSamplingSession, _json(request))
    await _sync(runs.session_of)(organization, body.session_id)
    sampler = await _sync(runs.sampler_for)(organization, body.model_path, body.base_model)
    return {"type": "create_sampling_session", "sampling_session_id": await open_sampler_async(sampler)}


@tinker_route()
async def asample(request: HttpRequest, organization: Organization) -> dict:
    """Accepted at once; the pool answers in the background and ``retrieve_future`` returns it."""
    call = parsed(SampleCall, _json(request))
    tokens = call.tokens()
    if call.sampling_session_id is not None:
        sampler = await sampler_of(organization.pk, call.sampling_session_id)
    else:
        sampler = await _sync(runs.sampler_for)(organization, call.model_path, call.base_model)
    request_id = await futures.accept(organization.pk)
    task = asyncio.create_task(_sample_into(request_id, sampler, call, tokens))
    _background.add(task)
    task.add_done_callback(_background.discard)
    return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}-{index}" for index in range(call.num_samples)]}


async def _sample_into(request_id: str, sampler: Sampler, call: SampleCall, tokens: list[int]) -> None:
    try:
        outcome = futures.result(SAMPLE, (await sample(sampler, call, tokens)).as_json())
    except api_errors.ApiError as exc:
        outcome = futures.failure(exc.message, by_user=exc.status < 500)
    await futures.finish_async(request_id, outcome)


@tinker_route()
async def retrieve_future(request: HttpRequest, organization: Organization) -> HttpResponse | dict:
    """The request's result once it is done (long-polled for up to ``futures.POLL_WAIT_S``), else
    ``try_again``; a failed request's error, with its category."""
    body = parsed(RetrieveFuture, _json(request))
    if await futures.owner(body.request_id) != organization.pk:
        raise api_errors.not_found("request", body.request_id, "request_id")
    outcome = await futures.outcome(body.request_id)
    if outcome is None:
        return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
    if "error" in outcome:
        return outcome
    kind, value = outcome["kind"], outcome["value"]
    if tinker_wire.PROTOBUF not in request.headers.get("Accept", ""):
        return _json_result(kind, value)
    if kind == FORWARD_BACKWARD:
        return HttpResponse(tinker_wire.forward_backward_output(value["logprobs"], value["metrics"]), content_type=tinker_wire.PROTOBUF)
    if kind == SAMPLE:
        sequences = [tinker_wire.Sequence(**sequence) for sequence in value["sequences"]]
        return HttpResponse(tinker_wire.sample_response(sequences, value["prompt_logprobs"]), content_type=tinker_wire.PROTOBUF)
    return _json_result(kind, value)


def _json_result(kind: str, value: dict) -> dict:
    """A result in the SDK's JSON shapes (for a client that did not ask for protobuf)."""
    if kind == FORWARD_BACKWARD:
        outputs = [{"logprobs": {"data": values, "dtype": "float32", "shape": [len(values)]}} for values in value["logprobs"]]
        return {"loss_fn_output_type": "ArrayRecord", "loss_fn_outputs": outputs, "metrics": value["metrics"]}
    if kind == SAMPLE:
        sequences = [
            {"stop_reason": "stop" if sequence["stopped"] else "length", "tokens": sequence["tokens"], "logprobs": sequence["logprobs"]}
            for sequence in value["sequences"]
        ]
        return {"type": "sample", "sequences": sequences, "prompt_logprobs": value["prompt_logprobs"]}
    return value


@tinker_route("GET")
async def training_runs(request: HttpRequest, organization: Organization) -> dict:
    return await _sync(runs.listed_runs)(organization, request.GET.get("limit"), request.GET.get("offset"))


@tinker_route("GET")
async def training_run(request: HttpRequest, organization: Organization, run_id: str) -> dict:
    return await _sync(runs.run_view)(organization, run_id)


@tinker_route("GET")
async def run_checkpoints(request: HttpRequest, organization: Organization, run_id: str) -> dict:
    return await _sync(runs.checkpoints_view)(organization, run_id)


@tinker_route()
async def publish_checkpoint(request: HttpRequest, organization: Organization, run_id: str, folder: str, name: str) -> dict:
    """The SDK's ``publish_checkpoint_from_tinker_path``: here, sampler weights become the model
    ``<base>:<suffix>`` (a JSON body may give ``suffix``; the weights' name otherwise)."""
    body = parsed(Publish, _json(request)) if request.body else Publish()
    model = await _sync(runs.publish)(organization, run_id, f"{folder}/{name}", body.suffix)
    return {"model": model}


@csrf_exempt
async def unknown(request: HttpRequest, rest: str = "") -> HttpResponse:
    """A route of the protocol this server does not offer: named, in the API's error shape."""
    return api_error(api_errors.ApiError(
        f"/api/v1/{rest[:200]} is not offered by this server (it serves the Tinker SDK's training, sampling, futures and "
        "checkpoint calls)", status=404, code="not_offered",
    ))
