"""The engine's sleep on the CPU (``inference.engine.sleep``), on a worker's KV cache as vLLM lays it
out: tensors that are views of shared storages. The engine test of the pool
(tests/test_scale_to_zero.py) measures the memory a real replica gives back and its answers after.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from inference.engine import sleep


def _worker() -> SimpleNamespace:
    """Two layers' caches in one storage (as vLLM shares one where it can), a third in its own."""
    shared = torch.ones(2, 1024)
    own = torch.ones(4, 256)
    return SimpleNamespace(model_runner=SimpleNamespace(kv_caches=[shared[0], shared[1], own.view(2, 512)]))


def test_sleep_gives_each_kv_cache_storage_back_and_wake_restores_its_size_under_the_same_views():
    worker = _worker()
    caches = worker.model_runner.kv_caches
    sizes = [cache.untyped_storage().nbytes() for cache in caches]
    sleep.sleep(worker, level=1)
    assert [cache.untyped_storage().nbytes() for cache in caches] == [0, 0, 0]
    sleep.sleep(worker, level=1)  # asleep already: the sizes to restore are kept
    sleep.wake_up(worker)
    assert [cache.untyped_storage().nbytes() for cache in caches] == sizes
    for cache in caches:  # the views vLLM holds work again: written and read at their shapes
        cache.fill_(2.0)
        assert cache.sum().item() == 2.0 * cache.numel()


def test_release_kv_cache_memory_discards_the_cache_and_refuses_other_tags_and_deeper_sleep():
    worker = _worker()
    sleep.discard(worker, ("kv_cache",))
    assert all(cache.untyped_storage().nbytes() == 0 for cache in worker.model_runner.kv_caches)
    with pytest.raises(RuntimeError, match="only the KV cache can be discarded on the CPU"):
        sleep.discard(worker, ("weights",))
    with pytest.raises(ValueError, match="sleep level 2 is not supported on the CPU"):
        sleep.sleep(_worker(), level=2)
