"""How the server starts vLLM's engine process: forked from the server rather than spawned.

vLLM's CPU platform asks for ``spawn``, so its engine process started a fresh interpreter and
imported torch, vLLM and this engine again before it could load a weight: 9.6 s of a replica's
24.3 s to ``/health`` here (``benchmarks/cold_start_timeline.py``). Forked, the engine process
starts with all of it imported, the kernels decided, checked and patched, and the replica answers
``/health`` after 16.8 s. Two things keep the fork sound on the CPU:

- GNU OpenMP's thread pool does not survive a fork: a child whose parent ran a parallel region on
  several threads waits forever in its own first one. So the server decides its kernels (whose
  known-answer check computes with torch and the C kernel, both on torch's OpenMP) on one thread
  (``one_thread``), and no pool exists when the engine process is forked.
- vLLM preloads torch's libgomp (LD_PRELOAD) into a spawned engine so that no other OpenMP runtime
  is loaded first; a forked one has the runtime the server loaded with torch, the same one.

Where vLLM must spawn anyway (in a Ray actor, under NUMA binding), its own check still decides so.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

START_METHOD_VARIABLE = "VLLM_WORKER_MULTIPROC_METHOD"


def wrap_check_and_update_config(stock: Callable[[Any], None]) -> classmethod:
    """vLLM's CPU platform's configuration check, which sets ``spawn``; then ``fork`` in its place."""

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        stock(vllm_config)
        os.environ[START_METHOD_VARIABLE] = "fork"

    return classmethod(check_and_update_config)


@contextmanager
def one_thread() -> Iterator[None]:
    """torch computes on one thread within (and the C kernel, which shares its OpenMP runtime)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
