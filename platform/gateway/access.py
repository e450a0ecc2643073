"""Who is calling and what they may use: ``accounts.services`` for the key, ``finetuning.registry``
for the model.

Both are ORM reads, about 1.5 ms each on a 2-core machine, plus a hop to a worker thread: most of
the gateway's budget. So a *granted* access is remembered for ``GRANT_TTL_S``: a burst of requests
with one key and model pays once. A refusal is never remembered (a model published a moment ago
is found on the first request that names it), and a revoked key or deleted model stops working
within ``GRANT_TTL_S``.

The reads run with ``thread_sensitive=False``: in the shared thread pool, whose threads keep their
database connections between requests, instead of a fresh thread (and connection) per request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from accounts.models import ApiKey, Organization, hash_key
from accounts.services import authenticate_key
from asgiref.sync import sync_to_async
from django.db import close_old_connections
from finetuning.registry import UsableModel, list_usable_models, resolve_model

from inference import errors

GRANT_TTL_S = 1.0
_MAX_GRANTS = 10_000  # a bound on memory, far above the callers one process serves in a second


@dataclass(frozen=True)
class Access:
    api_key: ApiKey
    model: UsableModel | None  # the requested model, when the caller may use it


_grants: dict[tuple[str, str | None], tuple[Access, float]] = {}


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


def _organization_model(organization: Organization, model_name: str) -> UsableModel | None:
    close_old_connections()
    return resolve_model(organization, model_name)


_authorize_in_thread = sync_to_async(_authorize, thread_sensitive=False)
usable_models = sync_to_async(_usable_models, thread_sensitive=False)
organization_model = sync_to_async(_organization_model, thread_sensitive=False)


async def authorize(raw_key: str, model_name: str | None) -> Access:
    """The caller's key, and the model they ask for if they may use it (else ``model`` is None)."""
    grant_key = (hash_key(raw_key), model_name)
    remembered = _grants.get(grant_key)
    now = time.monotonic()
    if remembered is not None and now - remembered[1] < GRANT_TTL_S:
        return remembered[0]
    access = await _authorize_in_thread(raw_key, model_name)  # raises for a bad key: not remembered
    if access.model is not None:
        if len(_grants) >= _MAX_GRANTS:
            _grants.clear()
        _grants[grant_key] = (access, now)
    return access
