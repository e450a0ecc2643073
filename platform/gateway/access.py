"""Who is calling and what they may use: ``accounts.services`` for the key, ``finetuning.registry``
for the model.

Both are ORM reads, about 1.5 ms each on a 2-core machine, plus a hop to a worker thread: most of
the gateway's budget. So a *granted* access is remembered for ``GRANT_TTL_S``: a burst of requests
with one key and model pays once. A refusal is never remembered (a model published a moment ago
is found on the first request that names it), and a revoked key or deleted model stops working
within ``GRANT_TTL_S`` in another process; in this one at once (``forget_grants``, on
``accounts.signals.access_withdrawn``: a revoked key, a removed member, a deactivated user).

The reads run with ``thread_sensitive=False``: in the shared thread pool, whose threads keep their
database connections between requests, instead of a fresh thread (and connection) per request.
A database outage in them is the 503 of ``base.database_outage``, whichever door called
(a Django view, or the ASGI fast path, which Django's middleware never sees).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from accounts.models import ApiKey, Organization, hash_key
from accounts.permissions import check_may_manage_models
from accounts.services import authenticate_key
from asgiref.sync import sync_to_async
from base.database_outage import outage_as_api_error
from django.db import close_old_connections
from core import api_errors
from core.api_errors import ApiError
from core.model_names import parse_model_name
from finetuning.models import FineTunedModel
from finetuning.registry import UsableModel, delete_fine_tuned_model, list_usable_models, resolve_model


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
        raise api_errors.invalid_api_key()
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


def _delete_model(api_key: ApiKey, model: UsableModel) -> None:
    if model.suffix is None:
        raise ApiError(
            f"{model.name} is a base model of the platform; only fine-tuned models can be deleted.",
            status=403, param="model", code="model_not_deletable",
        )
    whole = parse_model_name(model.name).model
    if whole != model.name:
        raise ApiError(
            f"{model.name} is a revision or a checkpoint of {whole}; they are deleted with it, not one by one "
            f"(to answer with another revision, roll {whole} back).",
            status=400, param="model", code="model_not_deletable",
        )
    close_old_connections()
    organization = api_key.organization
    check_may_manage_models(organization, api_key.created_by, "delete")
    fine_tuned = FineTunedModel.objects.for_org(organization).filter(name=model.name).first()
    if fine_tuned is None:  # deleted a moment ago by another request
        raise api_errors.model_not_found(model.name)
    delete_fine_tuned_model(fine_tuned)


_T = TypeVar("_T")


def _in_thread(function: Callable[..., _T]) -> Callable[..., Awaitable[_T]]:
    """``function`` as a coroutine run in the shared thread pool."""

    @functools.wraps(function)
    def call(*args: Any) -> _T:
        with outage_as_api_error():
            return function(*args)

    return sync_to_async(call, thread_sensitive=False)


_authorize_in_thread = _in_thread(_authorize)
usable_models = _in_thread(_usable_models)
organization_model = _in_thread(_organization_model)


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


def forget_grants(**_signal: object) -> None:
    """Forget every remembered grant: access was withdrawn somewhere (rare, so no bookkeeping of
    which grants it touched; the next request of each caller pays one check again)."""
    _grants.clear()


async def delete_model(api_key: ApiKey, model: UsableModel) -> None:
    """Delete a fine-tuned model; this process forgets its grants at once (others within GRANT_TTL_S)."""
    await _in_thread(_delete_model)(api_key, model)
    for grant_key in [key for key in _grants if key[1] == model.name]:
        _grants.pop(grant_key, None)
