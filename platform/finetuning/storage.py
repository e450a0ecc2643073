"""The platform's stores, built once per process from settings."""

from __future__ import annotations

import functools

from django.conf import settings

from core.adapter_store import AdapterStore, store_of
from core.archive_cache import ArchiveCache
from core.catalog import BaseModel
from core.object_store import ObjectStore, object_store

# Downloads' archives kept on this host's disk (each web host keeps its own): the least recently
# used go past this size.
ARCHIVE_CACHE_BYTES = 2 * 1024**3


@functools.lru_cache(maxsize=None)
def files() -> ObjectStore:
    return object_store(settings.CONFIG.files_path, settings.CONFIG.s3)


def checkpoints_prefix(job_id: str) -> str:
    """Where a job's checkpoints live in the file store (each attempt and step in a folder below)."""
    return f"checkpoints/{job_id}/"


@functools.lru_cache(maxsize=None)
def adapters(base: BaseModel) -> AdapterStore:
    """The dynamic LoRA path of a base model, where its fine-tunes are published (looked up by id,
    with the refusal a tenant reads when it is gone: ``finetuning.publishing.store_for``)."""
    return store_of(base, settings.CONFIG.s3)


@functools.lru_cache(maxsize=None)
def archives() -> ArchiveCache:
    """Adapter and checkpoint archives as downloads serve them, each built once (``finetuning.adapters``)."""
    return ArchiveCache(settings.CONFIG.data_dir / "download-archives", ARCHIVE_CACHE_BYTES)
