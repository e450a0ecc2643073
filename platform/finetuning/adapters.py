"""Adapters in and out of the platform, as PEFT folders packed in one archive.

Download: a fine-tuned model's adapter, or one of its job's checkpoints, as ``.tar.gz`` with
``adapter_config.json`` and ``adapter_model.safetensors`` at its root: it loads with
``PeftModel.from_pretrained`` and with vLLM's ``--lora-modules``. The archive is built on disk,
never whole in memory, once per published revision or checkpoint (``storage.archives``: packing
is gzip over the weights), and streamed from there.

Upload: an adapter trained elsewhere, served as ``<base model>:<suffix>`` like a trained one.
Everything is checked before anything is written (``core.adapter_archive``: the archive;
``core.adapter_check``: the adapter against the base model), and it counts against the
organization's upload rate and storage quota as a dataset does; ``finetuning.publishing`` publishes
it, as it does every adapter.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import IO

from django.conf import settings
from django.contrib.auth.models import User
from django.core.files.uploadedfile import UploadedFile

from accounts.models import Organization
from base.streaming import StreamedFileResponse
from core.adapter_archive import ADAPTER_FILES, pack, unpack
from core.adapter_check import check_adapter
from core.adapter_store import AdapterNotFound, AdapterStore, StoreUnavailable
from core.api_errors import adapter_not_found, adapter_store_unreachable, adapter_too_large
from core.model_names import ModelName, pinned_name, revision_in
from core.object_store import ObjectNotFound
from finetuning import job_creation, publishing, quotas, storage
from finetuning.models import Checkpoint, FineTunedModel


def archive_name(name: str) -> str:
    """A file name for a model or checkpoint name (``org/model:suffix`` holds '/' and ':')."""
    return name.replace("/", "--").replace(":", "--") + ".tar.gz"


def archive_response(archive: IO[bytes], name: str) -> StreamedFileResponse:
    """An adapter's archive (an open file), streamed in blocks and closed at the end: the download
    of the API and of the dashboard."""
    filename = archive_name(name)
    return StreamedFileResponse(archive, as_attachment=True, filename=filename, content_type="application/gzip")


def model_archive(model: FineTunedModel) -> IO[bytes]:
    """The adapter ``model`` answers with, packed (built once per published revision); the caller
    streams and closes it."""
    job_creation.catalog_model(model.base_model)  # its base model gone from the catalog: the 400 a new job gets
    store = publishing.store_for(model.base_model)
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
    publishing.check_suffix_free(name)
    quotas.charge_upload(organization)
    with tempfile.TemporaryDirectory(prefix="adapter-upload-") as work:
        folder = Path(work) / "adapter"
        folder.mkdir()
        unpack(_on_disk(upload, Path(work)), folder, limit)
        check_adapter(folder, base)
        return publishing.publish_upload(organization, name, folder)


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
