"""Sessions, training runs and their saved weights: what the Tinker protocol's calls do to the
database (the views only translate). Another organization's session, run or path is not found,
as if it did not exist.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from accounts.models import Organization
from base.celery import HOLD_TRAINING_RUN, send
from core.api_errors import ApiError, not_found
from core.model_names import ModelName, is_valid_suffix
from finetuning import publishing
from training_loops.models import SESSION_SILENT_S, CheckpointKind, LoopCheckpoint, LoopRun, LoopSession, RunStatus
from training_loops.samplers import Sampler

MAX_OPEN_RUNS_PER_ORGANIZATION = 4  # runs queued or held by a trainer: each holds a model in memory
# Sessions alive at once (not finished, their client beating): a session costs a row and its beats, and a
# client that opens them in a loop is a bug worth stopping early.
MAX_LIVE_SESSIONS_PER_ORGANIZATION = 32
MAX_RANK = 64
_PATH = re.compile(r"tinker://(?P<run>session_[A-Za-z0-9]{24}:train:\d{1,9})/(?P<folder>weights|sampler_weights)/(?P<name>[A-Za-z0-9._-]{1,128})")
NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


def create_session(organization: Organization, tags: list[str], user_metadata: dict | None, sdk_version: str, display_name: str) -> LoopSession:
    silent_since = timezone.now() - timedelta(seconds=SESSION_SILENT_S)
    live = LoopSession.objects.for_org(organization).filter(finished_at=None, heartbeat_at__gte=silent_since).count()
    if live >= MAX_LIVE_SESSIONS_PER_ORGANIZATION:  # a soft cap: two requests at once may both pass it
        raise ApiError(
            f"Your organization has {live} training sessions open (at most {MAX_LIVE_SESSIONS_PER_ORGANIZATION}); close "
            "one (ServiceClient.close), or wait: a session whose client stopped beating closes within "
            f"{SESSION_SILENT_S} s.", status=429, code="too_many_training_sessions", retry_after_s=30,
        )
    return LoopSession.objects.create(
        organization=organization, tags=tags, user_metadata=user_metadata, sdk_version=sdk_version[:40],
        display_name=display_name[:200],
    )


def session_of(organization: Organization, session_id: str) -> LoopSession:
    session = LoopSession.objects.for_org(organization).filter(pk=session_id).first()
    if session is None:
        raise not_found("session", session_id, "session_id")
    return session


def beat(organization: Organization, session_id: str) -> None:
    """The client is alive: its session's runs are not idle for that reason alone (they stop when no request comes)."""
    updated = LoopSession.objects.for_org(organization).filter(pk=session_id).update(heartbeat_at=timezone.now())
    if not updated:
        raise not_found("session", session_id, "session_id")


def finish(organization: Organization, session_id: str) -> None:
    """The client closed its session: its runs stop once their queued requests are done."""
    if not LoopSession.objects.for_org(organization).filter(pk=session_id, finished_at=None).update(finished_at=timezone.now()):
        session_of(organization, session_id)  # an unknown session is a 404; a finished one stays finished


def capabilities() -> list[dict]:
    """The catalog's models, each trainable and sampleable here."""
    return [
        {"model_name": model.id, "max_context_length": model.engine.max_model_len, "trainable": True, "sampleable": True}
        for model in settings.MODEL_CATALOG.models
    ]


@dataclass(frozen=True)
class RunShape:
    model_seq_id: int  # the SDK's count of the models it made in the session: the run's id is derived from it
    base_model: str
    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    user_metadata: dict | None = None


def create_run(organization: Organization, session_id: str, shape: RunShape, start_from: LoopCheckpoint | None = None,
               with_optimizer: bool = False) -> LoopRun:
    """A new training run, queued for a trainer once the transaction commits."""
    base = settings.MODEL_CATALOG.get(shape.base_model)
    if base is None:
        raise ApiError(f"base_model '{shape.base_model}' is not offered here; see get_server_capabilities", param="base_model",
                       code="model_not_available")
    if not 1 <= shape.rank <= min(MAX_RANK, base.lora.max_lora_rank):
        raise ApiError(f"lora_config.rank must be from 1 to {min(MAX_RANK, base.lora.max_lora_rank)} (what the serving "
                       f"engine takes for {base.id})", param="lora_config.rank")
    if not (shape.train_mlp or shape.train_attn):
        raise ApiError("lora_config: train_mlp or train_attn must be true (there is nothing else to train here)", param="lora_config")
    with transaction.atomic():
        session = LoopSession.objects.select_for_update().filter(organization=organization, pk=session_id).first()
        if session is None:
            raise not_found("session", session_id, "session_id")
        open_runs = LoopRun.objects.for_org(organization).filter(status__in=(RunStatus.QUEUED, RunStatus.RUNNING)).count()
        if open_runs >= MAX_OPEN_RUNS_PER_ORGANIZATION:
            raise ApiError(
                f"Your organization has {open_runs} training runs open (at most {MAX_OPEN_RUNS_PER_ORGANIZATION}); a run closes "
                "when its client stops sending requests.", status=429, code="too_many_training_runs", retry_after_s=30,
            )
        run_id = f"{session.pk}:train:{shape.model_seq_id}"
        if LoopRun.objects.filter(pk=run_id).exists():
            raise ApiError(f"This session made model {shape.model_seq_id} already ({run_id}); the SDK counts them",
                           status=409, param="model_seq_id", code="model_seq_id_taken")
        run = LoopRun.objects.create(
            id=run_id, session=session, organization=organization, base_model=base.id, lora_rank=shape.rank, seed=shape.seed,
            train_mlp=shape.train_mlp, train_attn=shape.train_attn, user_metadata=shape.user_metadata,
            start_from=start_from, start_with_optimizer=with_optimizer,
        )
        transaction.on_commit(lambda: send(HOLD_TRAINING_RUN, run.pk))
    return run


def run_of(organization: Organization, run_id: str, param: str = "model_id") -> LoopRun:
    run = LoopRun.objects.for_org(organization).filter(pk=run_id).first()
    if run is None:
        raise not_found("training run", run_id, param)
    return run


def open_run_of(organization: Organization, run_id: str) -> LoopRun:
    """A run that takes requests: a stopped or failed one says why, and what to do."""
    run = run_of(organization, run_id)
    if run.status == RunStatus.FAILED:
        raise ApiError(f"Training run {run.pk} failed: {run.error_message}", status=409, code="training_run_failed", param="model_id")
    if run.status == RunStatus.STOPPED:
        raise ApiError(
            f"Training run {run.pk} stopped (its session ended, or no request came for {settings.CONFIG.loop_idle_s} s); "
            "create a training client from its last saved state to go on.", status=409, code="training_run_stopped", param="model_id",
        )
    return run


def checkpoint_at(organization: Organization, path: str, param: str = "path") -> LoopCheckpoint:
    """The saved weights a ``tinker://<run>/{weights,sampler_weights}/<name>`` path names."""
    match = _PATH.fullmatch(path)
    if match is None:
        raise ApiError(f"'{path[:300]}' is not a path this server gave: tinker://<model_id>/weights/<name> or "
                       "tinker://<model_id>/sampler_weights/<name>", param=param)
    kind = CheckpointKind.STATE if match["folder"] == "weights" else CheckpointKind.SAMPLER
    checkpoint = (
        LoopCheckpoint.objects.filter(run__organization=organization, run_id=match["run"], kind=kind, name=match["name"])
        .select_related("run").first()
    )
    if checkpoint is None:
        raise not_found("checkpoint", path, param)
    return checkpoint


def checked_name(name: str | None) -> str | None:
    """A name for saved weights: the caller's (letters, digits, ``.``, ``_``, ``-``); None (or empty):
    the trainer names them."""
    if not name:
        return None
    if not NAME.fullmatch(name) or name in (".", ".."):
        raise ApiError("path must be 1-128 letters, digits, '.', '_' or '-' (it names a folder)", param="path")
    return name


def run_from_state(organization: Organization, session_id: str, model_seq_id: int, state: LoopCheckpoint,
                   with_optimizer: bool, user_metadata: dict | None) -> LoopRun:
    """A new run that starts from a saved state: its base model, rank and targets are the state's run's."""
    if state.kind != CheckpointKind.STATE:
        raise ApiError("a run starts from saved weights with their optimizer (tinker://.../weights/...), not from sampler "
                       "weights", param="path")
    source = state.run
    shape = RunShape(model_seq_id, source.base_model, source.lora_rank, source.seed, source.train_mlp, source.train_attn, user_metadata)
    return create_run(organization, session_id, shape, start_from=state, with_optimizer=with_optimizer)


def sampler_for(organization: Organization, model_path: str | None, base_model: str | None) -> Sampler:
    """What to sample from: saved sampler weights (``model_path``), or a base model of the catalog."""
    if model_path is not None:
        checkpoint = checkpoint_at(organization, model_path, "model_path")
        if checkpoint.served_as is None:
            raise ApiError("sample from sampler weights (tinker://.../sampler_weights/...): a training state is not served",
                           param="model_path")
        return Sampler(organization.pk, checkpoint.served_as, checkpoint.run.base_model)
    if base_model is None or settings.MODEL_CATALOG.get(base_model) is None:
        raise ApiError(f"base_model '{(base_model or '')[:200]}' is not offered here; give model_path or a base model of "
                       "get_server_capabilities", param="base_model")
    return Sampler(organization.pk, base_model, base_model)


def tokenizer_id(base_model: str) -> str:
    """What the SDK's ``get_tokenizer`` loads: the base model's weights folder, which holds its
    tokenizer (no model hub is needed, on the machine that serves it)."""
    return str(settings.MODEL_CATALOG.require(base_model).weights)


def _run_view(run: LoopRun) -> dict:
    last = run.checkpoints.filter(kind=CheckpointKind.STATE).first()
    sampler = run.checkpoints.filter(kind=CheckpointKind.SAMPLER).first()
    return {
        "training_run_id": run.pk, "base_model": run.base_model, "model_owner": run.organization.slug, "is_lora": True,
        "lora_rank": run.lora_rank, "corrupted": run.status == RunStatus.FAILED, "last_request_time": run.heartbeat_at or run.created_at,
        "last_checkpoint": _checkpoint_view(last) if last else None,
        "last_sampler_checkpoint": _checkpoint_view(sampler) if sampler else None, "user_metadata": run.user_metadata,
        "status": run.status, "error": run.error_message or None,
    }


def _checkpoint_view(checkpoint: LoopCheckpoint) -> dict:
    return {
        "checkpoint_id": checkpoint.checkpoint_id, "checkpoint_type": checkpoint.kind, "time": checkpoint.created_at,
        "tinker_path": checkpoint.path, "size_bytes": checkpoint.size_bytes, "public": False, "served_as": checkpoint.served_as,
    }


def listed_runs(organization: Organization, limit: str | None, offset: str | None) -> dict:
    page = max(1, min(_whole(limit, 20, "limit"), 100))
    start = _whole(offset, 0, "offset")
    found = LoopRun.objects.for_org(organization).select_related("organization")
    total = found.count()
    return {"training_runs": [_run_view(run) for run in found[start : start + page]], "cursor": {"offset": start, "limit": page, "total_count": total}}


def _whole(raw: str | None, default: int, param: str) -> int:
    if raw is None:
        return default
    if not raw.isdigit() or len(raw) > 9:
        raise ApiError(f"{param} must be a whole number below a billion, not '{raw[:20]}'", param=param)
    return int(raw)


def run_view(organization: Organization, run_id: str) -> dict:
    return _run_view(run_of(organization, run_id, "training_run_id"))


def checkpoints_view(organization: Organization, run_id: str) -> dict:
    run = run_of(organization, run_id, "training_run_id")
    return {"checkpoints": [_checkpoint_view(checkpoint) for checkpoint in run.checkpoints.all()]}


def publish(organization: Organization, run_id: str, checkpoint_id: str, suffix: str | None) -> str:
    """Sampler weights of the run as the fine-tuned model ``<base>:<suffix>`` (by default the
    weights' own name): a model like any other from then on (chat, revisions, evals, batches, its
    adapter's download). The model's name is returned."""
    checkpoint = checkpoint_at(organization, f"tinker://{run_id}/{checkpoint_id}", "checkpoint_id")
    if checkpoint.served_as is None:
        raise ApiError("publish sampler weights (sampler_weights/<name>): a training state is not an adapter", param="checkpoint_id")
    name = ModelName(checkpoint.run.base_model, suffix or checkpoint.name)
    if not is_valid_suffix(str(name.suffix)):
        raise ApiError("suffix must be 1-64 letters, digits, '_' or '-' (the weights' own name is used when none is given)",
                       param="suffix")
    lineage = {"origin": "training_loop", "training_run": checkpoint.run_id, "checkpoint": checkpoint.path}
    with tempfile.TemporaryDirectory() as folder:
        adapter = publishing.store_for(name.base_model_id).fetch(checkpoint.served_as, Path(folder))
        return publishing.publish_saved_weights(organization, name, adapter, lineage).name
