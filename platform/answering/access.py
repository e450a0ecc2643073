"""Whether an organization may have a model (or a mix) answer: the gateway's rule
(``finetuning.registry.resolve_model`` for the model, ``answering.forward.check_mix`` for a mix),
for callers without a request of their own (a run of an eval, checked when it is created and again
when its worker starts it)."""

from __future__ import annotations

from asgiref.sync import async_to_sync, sync_to_async

from accounts.models import Organization
from answering.batch import Target
from answering.forward import check_mix
from core import api_errors
from core.openai_protocol import AdapterShare, RoutedFields
from finetuning.registry import UsableModel, resolve_model


def usable_target(organization: Organization, target: Target, where: str = "") -> UsableModel:
    """The model ``target`` names, once it and every part of its mix are the organization's to use;
    otherwise the gateway's refusal (404 ``model_not_found``, 400 for a mix that cannot be), its
    ``param`` under ``where`` (``models.1`` makes ``models.1.model``)."""
    try:
        model = resolve_model(organization, target.model)
        if model is None:
            raise api_errors.model_not_found(target.model)
        shares = [AdapterShare(model=name, scale=scale) for name, scale in target.adapters] or None
        usable = sync_to_async(lambda name: resolve_model(organization, name))
        async_to_sync(check_mix)(model, RoutedFields(model=target.model, adapters=shares), usable)
    except api_errors.ApiError as exc:
        if where:
            exc.param = f"{where}.{exc.param}" if exc.param else where
        raise
    return model
