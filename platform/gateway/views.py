"""Thin views: method check, error shaping and counting in ``openai_endpoint``; work in the modules."""

from __future__ import annotations

import functools
import time

import httpx
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from gateway import metrics as gateway_metrics
from gateway.access import authorize, bearer_key, usable_models
from gateway.forwarding import forward_completion
from gateway.pool_client import pool_client, pool_url
from inference import errors
from inference.protocol import ModelCard, ModelList

PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"


def openai_endpoint(name: str, method: str):
    """Answer errors in OpenAI's shape and count every request; API clients send no CSRF token."""

    def decorate(view):
        @csrf_exempt
        @functools.wraps(view)
        async def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            try:
                if request.method != method:
                    raise errors.ApiError(405, f"Use {method} for this endpoint.", code="method_not_allowed")
                response = await view(request, *args, **kwargs)
            except errors.ApiError as exc:
                response = HttpResponse(exc.json_bytes(), status=exc.status, content_type="application/json")
            gateway_metrics.REQUESTS.labels(name, str(response.status_code)).inc()
            return response

        return wrapper

    return decorate


@openai_endpoint("chat/completions", "POST")
async def chat_completions(request: HttpRequest) -> HttpResponse:
    return await forward_completion(request, "chat/completions")


@openai_endpoint("completions", "POST")
async def completions(request: HttpRequest) -> HttpResponse:
    return await forward_completion(request, "completions")


def _card(model) -> ModelCard:
    return ModelCard(id=model.name, created=int(model.created_at.timestamp()), owned_by=model.owned_by, parent=model.parent)


@openai_endpoint("models", "GET")
async def list_models(request: HttpRequest) -> HttpResponse:
    models = await usable_models(bearer_key(request))
    return JsonResponse(ModelList(data=[_card(model) for model in models]).model_dump())


@openai_endpoint("models", "GET")
async def retrieve_model(request: HttpRequest, model: str) -> HttpResponse:
    access = await authorize(bearer_key(request), model)
    if access.model is None:
        raise errors.model_not_found(model)
    return JsonResponse(_card(access.model).model_dump())


async def metrics(request: HttpRequest) -> HttpResponse:
    """The gateway's counters, then the pool's metrics (per model, adapters, replicas)."""
    text = gateway_metrics.render()
    try:
        response = await pool_client().get(pool_url("/metrics"), timeout=2.0)
        text += response.content
    except httpx.HTTPError as exc:
        text += f"# the inference pool's metrics are unavailable: {exc!r}\n".encode()
    return HttpResponse(text, content_type=PROMETHEUS)
