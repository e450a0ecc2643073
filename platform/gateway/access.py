"""Who is calling and what they may use: the API key and the model registry, read in one trip.

These run in a worker thread (the ORM is synchronous). ``thread_sensitive=False`` lets them use
the shared thread pool, whose threads keep their database connections between requests, instead
of a fresh thread (and a fresh connection) for every request.
"""

from __future__ import annotations

from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.db import close_old_connections
from django.http import HttpRequest

from accounts.models import ApiKey
from accounts.services import authenticate_key
from finetuning.registry import UsableModel, list_usable_models, resolve_model
from inference import errors


@dataclass(frozen=True)
class Access:
    api_key: ApiKey
    model: UsableModel | None  # the requested model, when the caller may use it


def bearer_key(request: HttpRequest) -> str:
    scheme, _, raw_key = request.headers.get("Authorization", "").partition(" ")
    if scheme != "Bearer" or not raw_key.strip():
        raise errors.missing_api_key()
    return raw_key.strip()


def _api_key(raw_key: str) -> ApiKey:
    close_old_connections()  # what Django does at each request start, for this thread's connection
    api_key = authenticate_key(raw_key)
    if api_key is None:
        raise errors.invalid_api_key()
    return api_key


def _authorize(raw_key: str, model_name: str | None) -> Access:
    api_key = _api_key(raw_key)
    model = resolve_model(api_key.organization, model_name) if model_name is not None else None
    return Access(api_key, model)


def _usable_models(raw_key: str) -> list[UsableModel]:
    return list_usable_models(_api_key(raw_key).organization)


authorize = sync_to_async(_authorize, thread_sensitive=False)
usable_models = sync_to_async(_usable_models, thread_sensitive=False)
