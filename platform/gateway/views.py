"""Thin views: method check, error shaping and counting in ``openai_endpoint``; work in the modules.

The completion and Responses views stay beside the ASGI fast path (``gateway.asgi``, which answers
first under uvicorn): they serve WSGI, Django's test client and the schema fuzzer, and name the URLs.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

import httpx
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.http.response import HttpResponseBase
from django.views.decorators.csrf import csrf_exempt

from base.error_responses import api_error
from base.monitoring import from_monitoring
from base.serving_client import Serving, backend_url, backends, pool_client, serving_async
from core import api_errors
from core.catalog import BACKENDS
from core.openai_protocol import ModelCard, ModelList
from gateway import metrics as gateway_metrics
from gateway.access import authorize, delete_model, usable_models
from gateway.completions import bearer_key, complete, pool_response
from gateway.responses import lookup_refusal, respond
from finetuning.registry import UsableModel


_AsyncView = Callable[..., Coroutine[Any, Any, HttpResponseBase]]


def openai_endpoint(name: str, *methods: str) -> Callable[[_AsyncView], _AsyncView]:
    """Answer errors in OpenAI's shape and count every request; API clients send no CSRF token."""

    def decorate(view: _AsyncView) -> _AsyncView:
        @csrf_exempt
        @functools.wraps(view)
        async def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            try:
                if request.method not in methods:
                    raise api_errors.method_not_allowed(" or ".join(methods))
                response = await view(request, *args, **kwargs)
            except api_errors.ApiError as exc:
                response = api_error(exc)
            gateway_metrics.REQUESTS.labels(name, str(response.status_code)).inc()
            return response

        return wrapper

    return decorate


async def _completion(request: HttpRequest, endpoint: str) -> HttpResponseBase:
    return pool_response(await complete(request.headers.get("Authorization"), request.body, endpoint))


@openai_endpoint("chat/completions", "POST")
async def chat_completions(request: HttpRequest) -> HttpResponseBase:
    return await _completion(request, "chat/completions")


@openai_endpoint("completions", "POST")
async def completions(request: HttpRequest) -> HttpResponseBase:
    return await _completion(request, "completions")


@openai_endpoint("responses", "POST")
async def responses(request: HttpRequest) -> HttpResponseBase:
    return pool_response(await respond(request.headers.get("Authorization"), request.body))


@openai_endpoint("responses", "GET", "DELETE")
async def response(request: HttpRequest, response_id: str) -> HttpResponseBase:
    """Responses are not stored: a 404 that says so (to a caller with a valid key)."""
    raise await lookup_refusal(request.headers.get("Authorization"), response_id)


def _card(model: UsableModel, running: Serving | None) -> ModelCard:
    return ModelCard(
        id=model.name, created=int(model.created_at.timestamp()), owned_by=model.owned_by, parent=model.parent,
        lineage=model.lineage, revision=model.revision, serving=running.of(model) if running else None,
    )


@openai_endpoint("models", "GET")
async def list_models(request: HttpRequest) -> HttpResponse:
    models = await usable_models(bearer_key(request.headers.get("Authorization")))
    running = await serving_async()
    return JsonResponse(ModelList(data=[_card(model, running) for model in models]).model_dump())


@openai_endpoint("models", "GET", "DELETE")
async def model(request: HttpRequest, model: str) -> HttpResponse:
    """Retrieve a model, or (DELETE, as OpenAI's API) delete a fine-tuned model of the caller's."""
    access = await authorize(bearer_key(request.headers.get("Authorization")), model)
    if access.model is None:
        raise api_errors.model_not_found(model)
    if request.method == "DELETE":
        await delete_model(access.api_key, access.model)
        return JsonResponse({"id": model, "object": "model", "deleted": True})
    return JsonResponse(_card(access.model, await serving_async()).model_dump())


async def metrics(request: HttpRequest) -> HttpResponse:
    """The gateway's counters, then the metrics of the backends the catalog's models use (the
    embedded pool's, Ray Serve's: the same series, per model, adapters, replicas): for the
    operator's scraper only, as they name every organization's models."""
    if not from_monitoring(request):
        given = "Authorization" in request.headers
        return api_error(api_errors.internal_token_required("MONITORING_TOKEN", given=given))
    used = backends()
    scraped = await asyncio.gather(*(_backend_metrics(backend) for backend in BACKENDS if backend in used))
    text = gateway_metrics.joined(gateway_metrics.render(), *scraped)
    return HttpResponse(text, content_type=gateway_metrics.CONTENT_TYPE)


async def _backend_metrics(backend: str) -> bytes:
    """A backend's metrics text; a comment saying why instead when it has none to give (never an error)."""
    try:
        response = await pool_client().get(backend_url(backend, "/metrics"), timeout=2.0)
        response.raise_for_status()  # a refusal (say, INTERNAL_TOKEN differs from the backend's) is not metrics text
        return response.content
    except httpx.HTTPError as exc:
        name = "the Ray Serve application" if backend == "ray" else "the inference pool"
        return f"# {name}'s metrics are unavailable: {exc!r}\n".encode()
