"""Composed models: a new fine-tuned model from a weighted combination of an organization's own.

A request mix (``adapters`` on a completion) is the same sum, built for one request and named by
its content; a composition keeps it under a suffix of its own, so it can be shared, downloaded and
served without repeating the recipe. The combination is exact by default (``linear``); where its
rank (the sum of the parents' ranks) is more than the deployment serves, ``svd``, ``ties`` or
``dare_linear`` approximate it at a chosen rank and report how far off they are
(``core.lora_merge``). It is published like an uploaded adapter (``finetuning.publishing``) and
served on its first request; its lineage (parents, scales, method, error) is kept on the model.

Everything that can refuse a composition without reading a weight is checked first
(``plan_composition``: parents, name, rank, and the result's size against the storage quota), then
it is built (``build_composition``): in the request for ``linear``, on a worker for the others,
whose merges take seconds of both cores for a few rank-16 parents (``finetuning.compositions``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from accounts.models import Organization
from core import api_errors
from core.adapter_check import ATTENTION, MLP, architecture, check_adapter
from core.adapter_store import AdapterNotFound, StoreUnavailable
from core.api_errors import ApiError
from core.catalog import BaseModel
from core.lora_algebra import CannotMix, Part, check_mixable_config, write_adapter
from core.lora_merge import Method, merge, most_bytes
from core.model_names import ModelName, parse_model_name
from finetuning import job_creation, publishing, quotas
from finetuning.models import FineTunedModel


@dataclass(frozen=True)
class CompositionRequest:
    """What to compose: ``parents`` maps each fine-tuned model to its scale."""

    parents: dict[str, float]
    suffix: str | None = None
    method: Method = "linear"
    rank: int | None = None  # the result's, for the approximations (default: as much as is served)
    density: float = 0.5  # ties, dare_linear: the share of each delta's entries kept
    seed: int = 0  # dare_linear: its random drop


@dataclass(frozen=True)
class Plan:
    """A composition checked against everything that needs no weight read: its parents (the
    organization's, of one base model, mixable), its name (free), its rank (served) and its size at
    most (within the storage quota). Building it (``build_composition``) is the expensive part."""

    name: ModelName
    scales: dict[str, float]
    method: Method
    rank: int
    density: float
    seed: int
    estimated_bytes: int


def plan_composition(organization: Organization, request: CompositionRequest) -> Plan:
    """Every refusal a composition can get before its weights are read; nothing is written."""
    parents = _parents(organization, request.parents)
    base = job_creation.catalog_model(parents[0].base_model)
    name = ModelName(base.id, job_creation.chosen_suffix(request.suffix))
    publishing.check_suffix_free(name)
    configs = _configs(parents, base)
    rank = _rank(request, base, {model: int(config["r"]) for model, config in configs.items()})
    estimate = most_bytes(architecture(base.weights), _target_modules(configs.values()), rank)
    # The most it can take: over the quota, it is refused before any weight is read.
    reserved = quotas.reserved_bytes(organization)
    quotas.check_storage(organization, estimate, what="the composed model", param="parents", reserved=reserved)
    return Plan(name, dict(request.parents), request.method, rank, request.density, request.seed, estimate)


def build_composition(organization: Organization, plan: Plan, held_by: str | None = None) -> FineTunedModel:
    """Build, check, register and publish the composed model; nothing is written on a refusal.
    ``held_by``: the composition (``finetuning.compositions``) that holds the name meanwhile. The
    parents are read again: one may have been deleted since the plan was made."""
    parents = _parents(organization, plan.scales)
    base = job_creation.catalog_model(parents[0].base_model)
    with tempfile.TemporaryDirectory(prefix="compose-") as work:
        parts = [Part(folder, plan.scales[model.name]) for model, folder in _fetched(parents, base, Path(work))]
        try:
            merged = merge(parts, plan.method, plan.rank, plan.density, plan.seed)
        except CannotMix as exc:
            parent = next(model for model, part in zip(parents, parts) if part.folder == exc.folder)
            raise api_errors.adapter_not_mixable(parent.name, str(exc), param="parents") from None
        folder = write_adapter(merged.config, merged.tensors, Path(work) / "composed")
        check_adapter(folder, base)
        lineage = {
            "parents": [{"model": model.name, "scale": plan.scales[model.name]} for model in parents],
            "method": plan.method,
            "rank": merged.rank,
            "approximation_error": round(merged.approximation_error, 6),
        }
        if plan.method in ("ties", "dare_linear"):
            lineage["density"] = plan.density
        if plan.method == "dare_linear":
            lineage["seed"] = plan.seed
        return publishing.publish_composition(organization, plan.name, folder, lineage, held_by)


def _parents(organization: Organization, scales: dict[str, float]) -> list[FineTunedModel]:
    """The organization's models ``scales`` names, all fine-tunes of one base model, in its order."""
    if not scales:
        raise ApiError("'parents' must name at least one fine-tuned model.", param="parents", code="invalid_parents")
    limit = settings.CONFIG.request_limits.mix_adapters
    if len(scales) > limit.value:
        raise api_errors.over_limit("parents", "The number of parents", len(scales), limit.value, limit.setting)
    if all(scale == 0 for scale in scales.values()):
        raise ApiError(
            "Every scale in 'parents' is 0: that combination is the base model itself, which needs no new model.",
            param="parents", code="invalid_parents",
        )
    for name in scales:
        if parse_model_name(name).suffix is None:
            raise ApiError(
                f"`{name}` is a base model; 'parents' are fine-tuned models (of a base model, scale 0 of each is "
                "the base model itself).",
                param="parents", code="invalid_parents",
            )
    found = {model.name: model for model in FineTunedModel.objects.for_org(organization).filter(name__in=list(scales))}
    for name in scales:
        if name not in found:
            raise api_errors.model_not_found(name, param="parents")
    parents = [found[name] for name in scales]
    for model in parents[1:]:
        if model.base_model != parents[0].base_model:
            raise api_errors.not_a_fine_tune_of(model.name, parents[0].base_model, param="parents")
    return parents


def _fetched(parents: list[FineTunedModel], base: BaseModel, work: Path) -> list[tuple[FineTunedModel, Path]]:
    """Each parent's published adapter folder (a local store's own; an S3 store's copy in ``work``)."""
    store = publishing.store_for(base.id)
    folders = []
    for model in parents:
        try:
            folders.append((model, store.fetch(model.name, work / "parents")))
        except AdapterNotFound:
            raise api_errors.adapter_not_found(model.name, param="parents") from None
        except StoreUnavailable as exc:
            raise api_errors.adapter_store_unreachable(model.name, str(exc)) from None
    return folders


def _configs(parents: list[FineTunedModel], base: BaseModel) -> dict[str, dict]:
    """Each parent's published adapter config (not its weights), checked to be one a sum covers."""
    store = publishing.store_for(base.id)
    configs = {}
    for model in parents:
        try:
            configs[model.name] = config = store.config(model.name)
            check_mixable_config(config)
        except AdapterNotFound:
            raise api_errors.adapter_not_found(model.name, param="parents") from None
        except StoreUnavailable as exc:
            raise api_errors.adapter_store_unreachable(model.name, str(exc)) from None
        except CannotMix as exc:
            raise api_errors.adapter_not_mixable(model.name, str(exc), param="parents") from None
    return configs


def _target_modules(configs: Iterable[dict]) -> set[str]:
    """The modules the result adapts: every module a parent adapts (all of the base model's linear
    layers for a parent that names them otherwise than as a list, an upper bound)."""
    modules: set[str] = set()
    for config in configs:
        targets = config.get("target_modules")
        known = isinstance(targets, list) and all(target in ATTENTION + MLP for target in targets)
        modules |= set(targets) if known and targets is not None else set(ATTENTION + MLP)
    return modules


def _rank(composition: CompositionRequest, base: BaseModel, ranks: dict[str, int]) -> int:
    """The result's rank: the sum of the parents' for ``linear`` (refused over what is served), else
    the one asked for (default: the sum, capped at what is served)."""
    served = base.lora.max_lora_rank
    exact = sum(ranks.values())
    if composition.method == "linear":
        if composition.rank is not None and composition.rank != exact:
            raise ApiError(
                f"'rank' sets the rank of an approximation (method svd, ties or dare_linear); the exact 'linear' "
                f"combination has the sum of its parents' ranks, {exact}.",
                param="rank", code="invalid_rank",
            )
        if exact > served:
            raise api_errors.composition_rank_too_large(ranks, served)
        return exact
    rank = composition.rank if composition.rank is not None else min(exact, served)
    if rank > served:
        raise api_errors.over_limit("rank", "The rank", rank, served, "max_lora_rank")
    return rank
