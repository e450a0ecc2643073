"""A trainer holding one training run (the Tinker protocol): it claims the run, loads the base
model with the run's LoRA and optimizer, and does the run's requests in the order they came
(``training_loops.futures``), until no request has come for ``LOOP_IDLE_SECONDS``.

Each request's outcome is recorded for ``retrieve_future``: a request at fault (a bad loss input,
an unknown path) fails alone and the run goes on; a trainer that dies leaves the run's beat silent,
and the sweeper fails the run naming its last saved state (``training_loops.lost_runs``).
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from django.conf import settings
from django.db import connection
from django.utils import timezone

from core.api_errors import ApiError
from core.freed_memory import give_back_freed_memory
from finetuning import publishing, storage
from training_loops import futures
from training_loops.futures import FORWARD_BACKWARD, JSON
from training_loops.models import CheckpointKind, LoopCheckpoint, LoopRun, LoopSession, RunStatus
from training_loops.samplers import Sampler, open_sampler
from workers.training.model import ADAPTER_FILES
from workers.training_loop.loop_model import OPTIMIZER_FILE, AdamStep, LoopModel, LoraShape, LossInput

log = logging.getLogger(__name__)

WAIT_S = 2.0  # between beats while no request comes
UNNAMED = "sampler-"  # the name of an unnamed sampler save, before its number
KEPT_UNNAMED = 2  # the sampling client of the previous save may still be sampling
_STATE_FILES = (*ADAPTER_FILES, OPTIMIZER_FILE)  # a saved state: the adapter and its optimizer


class RequestRefused(Exception):
    """A request this run cannot do (its inputs, or a path): it fails alone, by the caller's fault."""


def run_training_loop(run_id: str, worker: str) -> str:
    """Hold the run until it is idle; the status it ended with."""
    if not LoopRun.objects.filter(pk=run_id, status=RunStatus.QUEUED).update(
        status=RunStatus.RUNNING, worker=worker, heartbeat_at=timezone.now()
    ):
        return "taken"  # another trainer holds it, or it ended
    run = LoopRun.objects.select_related("start_from", "start_from__run").get(pk=run_id)
    try:
        model = _loaded(run)
    except Exception as exc:  # noqa: BLE001 - the run fails visibly, whatever kept its model from loading
        log.exception("training run %s: the model did not load", run_id)
        _end(run, RunStatus.FAILED, f"its trainer could not load the model ({type(exc).__name__})")
        return RunStatus.FAILED
    return _serve(run, model)


def _loaded(run: LoopRun) -> LoopModel:
    base = settings.MODEL_CATALOG.require(run.base_model)
    model = LoopModel(str(base.weights), base.id, LoraShape(run.lora_rank, run.seed, run.train_mlp, run.train_attn))
    if run.start_from is not None:
        with tempfile.TemporaryDirectory() as folder:
            model.load_state(_fetched_state(run.start_from, Path(folder)), with_optimizer=run.start_with_optimizer)
    return model


def _serve(run: LoopRun, model: LoopModel) -> str:
    client = futures.sync_redis()
    idle_since = time.monotonic()
    while True:
        if not LoopRun.objects.filter(pk=run.pk, status=RunStatus.RUNNING).update(heartbeat_at=timezone.now()):
            return "lost"  # failed by the sweeper meanwhile: nothing more is written
        popped = client.blpop([futures.ops_key(run.pk)], timeout=WAIT_S)
        if popped is None:
            give_back_freed_memory()  # a run between requests holds its model, not its last step's activations
            session = LoopSession.objects.filter(pk=run.session_id).first()  # None: deleted with its organization
            if session is None or session.is_gone(timezone.now()) or time.monotonic() - idle_since > settings.CONFIG.loop_idle_s:
                _end(run, RunStatus.STOPPED, "")
                return RunStatus.STOPPED
            continue
        operation = json.loads(popped[1])
        futures.finish(client, operation["request_id"], _outcome(run, model, operation, client))
        idle_since = time.monotonic()


def _outcome(run: LoopRun, model: LoopModel, operation: dict[str, Any], client: Any) -> dict[str, Any]:
    try:
        kind, value = _do(run, model, operation, client)
        return futures.result(kind, value)
    except (RequestRefused, ValueError, ApiError) as exc:
        return futures.failure(str(getattr(exc, "message", exc)), by_user=True)
    except Exception as exc:  # noqa: BLE001 - one request failing must not take the run's state with it
        log.exception("training run %s: %s failed", run.pk, operation.get("op"))
        return futures.failure(f"the trainer failed this request ({type(exc).__name__})", by_user=False)
    finally:
        connection.close_if_unusable_or_obsolete()


def _do(run: LoopRun, model: LoopModel, operation: dict[str, Any], client: Any) -> tuple[str, Any]:
    op = operation["op"]
    if op == "forward_backward":
        data = [LossInput(datum["tokens"], {name: np.asarray(values) for name, values in datum["inputs"].items()}) for datum in operation["data"]]
        done = model.forward_backward(data, operation["loss_fn"], operation["loss_fn_config"], operation["forward_only"])
        return FORWARD_BACKWARD, {"logprobs": [values.tolist() for values in done.logprobs], "metrics": done.metrics}
    if op == "optim_step":
        metrics = model.optim_step(AdamStep(**operation["adam"]))
        LoopRun.objects.filter(pk=run.pk).update(steps=run.steps + 1)
        run.steps += 1
        return JSON, {"type": "optim_step", "metrics": metrics}
    if op == "save_state":
        checkpoint = _save_state(run, model, operation["name"] or f"step-{run.steps:06d}")
        return JSON, {"type": "save_weights", "path": checkpoint.path}
    if op == "save_sampler":
        checkpoint = _save_sampler(run, model, operation["name"])
        answer = {"type": "save_weights_for_sampler", "path": checkpoint.path}
        if operation["open_sampler"]:
            answer["sampling_session_id"] = open_sampler(client, Sampler(run.organization_id, str(checkpoint.served_as), run.base_model))
        return JSON, answer
    if op == "load_state":
        state = LoopCheckpoint.objects.select_related("run").get(pk=operation["checkpoint"])
        if state.kind != CheckpointKind.STATE:
            raise RequestRefused("load saved weights with their optimizer (tinker://.../weights/...), not sampler weights")
        with tempfile.TemporaryDirectory() as folder:
            model.load_state(_fetched_state(state, Path(folder)), with_optimizer=operation["with_optimizer"])
        return JSON, {"type": "load_weights", "path": state.path, "model_id": run.pk}
    raise RequestRefused(f"unknown operation {op!r}")


def _save_state(run: LoopRun, model: LoopModel, name: str) -> LoopCheckpoint:
    """Weights and optimizer into the file store, under the run's folder: what a run goes on from."""
    prefix = f"training-loops/{run.pk}/{name}/"
    with tempfile.TemporaryDirectory() as folder:
        saved = model.save_state(Path(folder) / "state")
        size = 0
        for file in _STATE_FILES:
            storage.files().put_file(prefix + file, saved / file)
            size += (saved / file).stat().st_size
    checkpoint, _ = LoopCheckpoint.objects.update_or_create(
        run=run, kind=CheckpointKind.STATE, name=name, defaults={"storage_key": prefix, "size_bytes": size}
    )
    return checkpoint


def _fetched_state(state: LoopCheckpoint, folder: Path) -> Path:
    for file in _STATE_FILES:
        (folder / file).write_bytes(storage.files().get(state.storage_key + file))
    return folder


def _save_sampler(run: LoopRun, model: LoopModel, name: str | None) -> LoopCheckpoint:
    """The adapter as the next revision of the run's served model: the pool answers with it on its
    first request (a new name each save, so no replica answers with older weights)."""
    revision = run.sampler_saves + 1
    with tempfile.TemporaryDirectory() as folder:
        adapter = model.save_adapter(Path(folder) / "adapter")
        publishing.store_for(run.base_model).write_revision(str(run.served_model), revision, adapter)
        size = sum((adapter / file).stat().st_size for file in ADAPTER_FILES)
    LoopRun.objects.filter(pk=run.pk).update(sampler_saves=revision)
    run.sampler_saves = revision
    checkpoint, _ = LoopCheckpoint.objects.update_or_create(
        run=run, kind=CheckpointKind.SAMPLER, name=name or f"{UNNAMED}{revision:06d}",
        defaults={"revision": revision, "size_bytes": size},
    )
    if name is None:
        _drop_unnamed_before(run, revision - KEPT_UNNAMED + 1)
    return checkpoint


def _drop_unnamed_before(run: LoopRun, revision: int) -> None:
    """An unnamed save serves the sampling client made with it, which a loop replaces at its next
    save: only the last KEPT_UNNAMED are kept (an RL loop saving every step would otherwise keep them
    all). Named saves stay."""
    store = publishing.store_for(run.base_model)
    for checkpoint in run.checkpoints.filter(kind=CheckpointKind.SAMPLER, name__startswith=UNNAMED, revision__lt=revision):
        store.delete(str(checkpoint.served_as))
        checkpoint.delete()


def _end(run: LoopRun, status: str, message: str) -> None:
    LoopRun.objects.filter(pk=run.pk, status=RunStatus.RUNNING).update(status=status, error_message=message)
