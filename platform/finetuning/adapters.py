"""Adapters in and out of the platform, as PEFT folders packed in one archive.

Download: a fine-tuned model's adapter, or one of its job's checkpoints, as ``.tar.gz`` with
``adapter_config.json`` and ``adapter_model.safetensors`` at its root: it loads with
``PeftModel.from_pretrained`` and with vLLM's ``--lora-modules``. The archive is built on disk,
never whole in memory, once per published revision or checkpoint (``storage.archives``: packing
is gzip over the weights), and streamed from there.

Upload: an adapter trained elsewhere, served as ``<base model>:<suffix>`` like a trained one.
Everything is checked before anything is written (``core.adapter_archive``: the archive;
``core.adapter_check``: the adapter against the base model), and it counts against the
organization's upload rate and storage quota as a dataset does.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from django.conf import settings
from django.contrib.auth.models import User
from django.core.files.uploadedfile import UploadedFile
from django.db import IntegrityError, transaction

from accounts.models import Organization
from core.adapter_archive import ADAPTER_FILES, pack, unpack
from core.adapter_check import check_adapter, served_config
from core.adapter_store import AdapterNotFound, AdapterStore, StoreUnavailable
from core.api_errors import adapter_not_found, adapter_store_unreachable, adapter_too_large, suffix_taken
from core.model_names import ModelName, pinned_name, revision_in
from core.object_store import ObjectNotFound
from finetuning import job_creation, quotas, revisions, storage
from finetuning.models import Checkpoint, Composition, FineTunedModel, FineTuningJob


def archive_name(name: str) -> str:
    """A file name for a model or checkpoint name (``org/model:suffix`` holds '/' and ':')."""
    return name.replace("/", "--").replace(":", "--") + ".tar.gz"


def model_archive(model: FineTunedModel) -> IO[bytes]:
    """The adapter ``model`` answers with, packed (built once per published revision); the caller
    streams and closes it."""
    base = job_creation.catalog_model(model.base_model)
    store = storage.adapters(base.lora.dynamic_lora_loading_path)
    try:
        published = store.version(model.name)
        if published is None:
            raise AdapterNotFound(model.name)
        # The revision by its own name: what the bare name points at may move while it is packed.
        pinned = pinned_name(model.name, published.version)
        source = pinned if revision_in(pinned) is not None else model.name  # (adapters from before revisions)
        # The row's identity too: a model deleted and made again under its name starts again at r1.
        key = f"model {model.pk} {model.created_at.isoformat()} {pinned}"
        return storage.archives().open(key, lambda out: _pack_published(store, source, out))
    except AdapterNotFound:
        raise adapter_not_found(model.name) from None
    except StoreUnavailable as exc:
        raise adapter_store_unreachable(model.name, str(exc)) from None


def _pack_published(store: AdapterStore, name: str, out: IO[bytes]) -> None:
    with tempfile.TemporaryDirectory(prefix="adapter-download-") as cache:
        pack(store.fetch(name, Path(cache)), out)  # a local store's own folder; S3's copy in cache


def checkpoint_archive(checkpoint: Checkpoint) -> IO[bytes]:
    """A job's checkpoint (the adapter saved at an epoch's end), packed like a model's adapter, once."""
    key = f"checkpoint {checkpoint.pk} {checkpoint.storage_key}"  # a checkpoint's files never change
    try:
        return storage.archives().open(key, lambda out: _pack_checkpoint(checkpoint, out))
    except ObjectNotFound:
        raise adapter_not_found(checkpoint.name) from None


def _pack_checkpoint(checkpoint: Checkpoint, out: IO[bytes]) -> None:
    store = storage.files()
    with tempfile.TemporaryDirectory(prefix="checkpoint-download-") as folder:
        for name in ADAPTER_FILES:
            with store.open(f"{checkpoint.storage_key}/{name}") as source, (Path(folder) / name).open("wb") as target:
                shutil.copyfileobj(source, target)
        pack(Path(folder), out)


def upload_adapter(
    organization: Organization, user: User | None, upload: UploadedFile, model_id: str, suffix: str | None
) -> FineTunedModel:
    """Check an uploaded adapter archive against base model ``model_id``, publish it and register
    it as ``<model_id>:<suffix>``. Nothing is written unless every check passes."""
    base = job_creation.catalog_model(model_id)
    name = ModelName(base.id, job_creation.chosen_suffix(suffix))
    limit = settings.CONFIG.max_adapter_upload_bytes
    if upload.size is None or upload.size > limit:
        raise adapter_too_large(limit)  # before reading it
    check_suffix_free(name)
    quotas.charge_upload(organization)
    with tempfile.TemporaryDirectory(prefix="adapter-upload-") as work:
        folder = Path(work) / "adapter"
        folder.mkdir()
        unpack(_on_disk(upload, Path(work)), folder, limit)
        check_adapter(folder, base)
        return publish_new_model(organization, name, folder)


def publish_new_model(
    organization: Organization,
    name: ModelName,
    folder: Path,
    composition: dict | None = None,
    held_by: str | None = None,
) -> FineTunedModel:
    """Register and publish the adapter in ``folder`` (checked already) as ``name``: an uploaded
    adapter, or (with ``composition``) a composed one, ``held_by`` the id of the composition that
    holds the name when it was built on a worker. Its size counts against the organization's
    storage quota. Nothing stays registered if publishing fails."""
    served_config(folder, name.base_model_id)
    size = sum((folder / file).stat().st_size for file in ADAPTER_FILES)
    stored = _Stored("the composed model", "parents") if composition is not None else _Stored("this adapter", "file")
    quotas.check_storage(organization, size, what=stored.what, param=stored.param)
    model = _register(organization, name, size, composition, stored, held_by)
    try:
        storage.adapters(job_creation.catalog_model(name.base_model_id).lora.dynamic_lora_loading_path).publish(model.name, folder, model.revision)
    except BaseException as exc:
        model.delete()  # the name is free again; nothing was published
        if isinstance(exc, StoreUnavailable):
            raise adapter_store_unreachable(model.name, str(exc)) from None
        raise
    return model


@dataclass(frozen=True)
class _Stored:
    what: str  # as a quota refusal names it
    param: str


def check_suffix_free(name: ModelName, held_by: str | None = None) -> None:
    """The suffix names one adapter for everyone: no model has it, no job trains it, and no
    composition under way builds it (a job and a composition hold their suffix from creation, as
    they will publish under it), but for ``held_by``, the composition publishing it now."""
    compositions = Composition.objects.unfinished().filter(model=str(name)).exclude(pk=held_by)
    if (
        FineTunedModel.objects.filter(name=str(name)).exists()
        or FineTuningJob.objects.filter(model=name.base_model_id, suffix=name.suffix).exists()
        or compositions.exists()
    ):
        raise suffix_taken(str(name))


def _register(
    organization: Organization,
    name: ModelName,
    size: int,
    composition: dict | None,
    stored: _Stored,
    held_by: str | None,
) -> FineTunedModel:
    """The registry row before the adapter is published, so that of two uploads under one name only
    one publishes (the unique name decides). Until it is published a request for it is a 404."""
    assert name.suffix is not None  # a fine-tuned model's name (job_creation.chosen_suffix)
    try:
        with transaction.atomic():
            quotas.check_storage(organization, size, locked=True, what=stored.what, param=stored.param)
            check_suffix_free(name, held_by)
            model = FineTunedModel.objects.create(
                name=str(name), organization=organization, job=None, base_model=name.base_model_id,
                suffix=name.suffix, uploaded_bytes=size, composition=composition,
            )  # fmt: skip
            revisions.register_first(model)
            return model
    except IntegrityError:
        raise suffix_taken(str(name)) from None


def _on_disk(upload: UploadedFile, work: Path) -> Path:
    """The uploaded archive as a file (Django spools a large upload to disk; a small one is in memory)."""
    path = getattr(upload, "temporary_file_path", None)
    if path is not None:
        return Path(path())
    target = work / "archive"
    upload.seek(0)
    with target.open("wb") as out:
        shutil.copyfileobj(upload, out)
    return target
