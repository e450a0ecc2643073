"""Mixes and scales computed in the LoRA kernel: no combined adapter is built, loaded or cached.

A mix (``inference.adapter_mix``) reaches vLLM as an adapter of its own name whose folder holds only
a manifest (``inference.engine_contract.MANIFEST``, written by the pool): its parts, adapters the
replica holds, each with its scale. vLLM never loads it as weights. vLLM's server registers its name
without a call to the engine (``wrap_load_lora_adapter``), and in the engine's worker process:

- ``add_adapter`` of a folder with a manifest (at the first step that serves the mix) records the
  mix (``_mixes``) instead of loading it; it takes no slot and no memory but the manifest's few bytes;
- ``set_active_adapters`` (once per engine step) puts the parts of the batch's mixes in slots in the
  mixes' stead and points vLLM's LoRA mapping for a mix's tokens at its first part (its own code,
  the embedding and logits paths, sees a loaded adapter), and keeps what the mapping said
  (``StepMixes``) for the kernel;
- the kernel's plan (``inference.engine.plan.plan``) gives each token its (slot, scale) pairs:
  one, of scale 1, for a plain adapter; a mix's parts at their scales for a mix's token. The
  C kernel adds ``sum_k scale_k * x @ A_k @ B_k`` (vLLM has folded each part's ``lora_alpha / r``
  into its B), which is PEFT's ``add_weighted_adapter(combination_type="cat")``.

So a mix costs its parts' slots only, any scale costs nothing, a part shared by many mixes is held
once, and a mix's rank is its parts' own (no sum to cap). The pool keeps a mix's parts loaded while
the mix is held and its requests run, and counts the parts, not the mix, in vLLM's batch slots
(``inference.adapters``). Replicas where this cannot apply (vLLM's own kernels, torch's products)
say so (``KernelsState.mixes_in_kernel``) and get built adapters instead.

The ``wrap_*`` functions here wrap vLLM's methods; which ones, and when, is in
``inference.engine.replacements`` (patched only after the mixed known-answer step passes).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inference.engine_contract import MixManifest, read_manifest

log = logging.getLogger("inference.engine.mixes")


@dataclass(frozen=True)
class StepMixes:
    """What vLLM's mapping said for one step, before the mixes' tokens were pointed at a part."""

    index_mapping: tuple[int, ...]  # each token's adapter id as the batch asked (0: none)
    parts: dict[int, tuple[tuple[int, float], ...]]  # mix id -> its parts' adapter ids and scales


# vLLM adapter id -> the mix it names, least recently served first. vLLM's server unregisters a
# mix without telling the engine, so the worker forgets the least recently served past
# MIXES_REMEMBERED (a client sending a new scale each time makes a new mix each time); one
# forgotten while still registered is read again from its folder at its next step.
MIXES_REMEMBERED = 4096
_mixes: OrderedDict[int, MixManifest] = OrderedDict()
_requests: dict[str, Any] = {}  # adapter name -> the LoRARequest it was last added with
_step: StepMixes | None = None  # this step's, between set_active_adapters and the kernel's plan
_accepting = False  # whether this process computes mixes in the kernel (``accept``)


def accept(in_kernel: bool) -> None:
    """Set once by ``inference.engine.install``: whether a mix's manifest may be loaded here."""
    global _accepting
    _accepting = in_kernel


def step_mixes(index_mapping: tuple[int, ...]) -> StepMixes | None:
    """The mixes of the step whose (rewritten) mapping has these tokens; None: no mix in it."""
    if _step is None or len(_step.index_mapping) != len(index_mapping):
        return None
    return _step


@contextmanager
def stepping(index_mapping: tuple[int, ...], parts: dict[int, tuple[tuple[int, float], ...]]) -> Iterator[None]:
    """Within: the kernel's plan sees these mixes (the start-up check drives a mixed step this way)."""
    global _step
    previous, _step = _step, StepMixes(index_mapping, parts)
    try:
        yield
    finally:
        _step = previous


def wrap_add_adapter(original: Callable[[Any, Any], bool]) -> Callable[[Any, Any], bool]:
    """vLLM's worker calls ``add_adapter`` for each of a step's adapters, every step. For one it
    holds already, vLLM's own code first tests membership in ``list_adapters()``, a copy of the
    whole warm tier's index (a thousand entries, copied in Python, for each adapter of each step);
    here that case is a lookup, then what vLLM does next for it (activate it in a slot)."""
    from vllm.utils.gpu_sync_debug import gpu_sync_allowed

    def add_adapter(self: Any, lora_request: Any) -> bool:
        lora_id = lora_request.lora_int_id
        if lora_id in _mixes:
            return True
        manager = self._adapter_manager
        held = manager.get_adapter(lora_id) is not None
        if not held and _recorded_mix(lora_request):
            return True
        if held and not getattr(lora_request, "load_inplace", False):  # not to be loaded again in its place
            with gpu_sync_allowed():
                manager.activate_adapter(lora_id)
            added = True
        else:
            added = original(self, lora_request)
        _requests[lora_request.lora_name] = lora_request
        return added

    return add_adapter


def _recorded_mix(lora_request: Any) -> bool:
    """Record the mix whose manifest the request's folder holds; False: an adapter's folder."""
    manifest = read_manifest(Path(lora_request.lora_path))
    if manifest is None:
        return False
    if not _accepting:
        raise ValueError("this replica builds mixes as adapters: it cannot serve a mix's manifest")
    _mixes[lora_request.lora_int_id] = manifest
    while len(_mixes) > MIXES_REMEMBERED:
        _mixes.popitem(last=False)
    log.info("mix %s: %s", lora_request.lora_name, manifest.parts)
    return True


def wrap_load_lora_adapter(original: Callable[..., Any]) -> Callable[..., Any]:
    """In vLLM's server: a mix's folder is registered under its name without asking the engine.
    vLLM's own load asks the engine to add the adapter, which waits for the engine's step under
    way; a mix's manifest is read by the engine's worker at the first step that serves it
    (``wrap_add_adapter``), so its first request waits for nothing a warm adapter's does not."""
    from vllm.lora.request import LoRARequest

    async def load_lora_adapter(self: Any, request: Any, base_model_name: str | None = None) -> Any:
        try:
            manifest = read_manifest(Path(request.lora_path)) if _accepting and request.lora_path else None
        except ValueError:
            manifest = None  # vLLM's own load, whose engine reports the broken manifest
        if manifest is None or request.load_inplace:
            return await original(self, request, base_model_name)
        async with self.lora_resolver_lock[request.lora_name]:
            problem = await self._check_load_lora_adapter_request(request)
            if problem is not None:
                return problem
            registered = LoRARequest(request.lora_name, self.lora_id_counter.inc(1), request.lora_path)
            if base_model_name is not None and self.is_base_model(base_model_name):
                registered.base_model_name = base_model_name  # as vLLM's own load does
            self.lora_requests[request.lora_name] = registered
        log.info("mix %s registered: %s", request.lora_name, manifest.parts)
        return f"Success: mix '{request.lora_name}' registered."

    return load_lora_adapter


def wrap_remove_adapter(original: Callable[[Any, int], bool]) -> Callable[[Any, int], bool]:
    def remove_adapter(self: Any, adapter_id: int) -> bool:
        if _mixes.pop(adapter_id, None) is not None:
            return True
        for name, request in list(_requests.items()):
            if request.lora_int_id == adapter_id:
                del _requests[name]
        return original(self, adapter_id)

    return remove_adapter


def wrap_list_adapters(original: Callable[[Any], set[int]]) -> Callable[[Any], set[int]]:
    def list_adapters(self: Any) -> set[int]:
        return original(self) | _mixes.keys()

    return list_adapters


def wrap_set_active_adapters(original: Callable[[Any, set[Any], Any], None]) -> Callable[[Any, set[Any], Any], None]:
    def set_active_adapters(self: Any, requests: set[Any], mapping: Any) -> None:
        for request in requests:  # a mix the server registered (``wrap_load_lora_adapter``), at its first step
            if (
                request
                and request.lora_int_id not in _mixes
                and self._adapter_manager.get_adapter(request.lora_int_id) is None
            ):
                _recorded_mix(request)
        mixed = {request.lora_int_id for request in requests if request and request.lora_int_id in _mixes}
        for mix_id in mixed:
            _mixes.move_to_end(mix_id)
        had_mixes = getattr(self, "_fineserve_had_mixes", False)
        self._fineserve_had_mixes = bool(mixed)
        if not mixed:
            if had_mixes and mapping is not None:
                self._adapter_manager._last_mapping = None  # the last plan had mixes: plan afresh
            original(self, requests, mapping)
            return
        kept = {request for request in requests if not (request and request.lora_int_id in mixed)}
        parts: dict[int, tuple[tuple[int, float], ...]] = {}
        for mix_id in mixed:
            part_requests = [(_part_request(name), scale) for name, scale in _mixes[mix_id].parts]
            kept.update(request for request, _ in part_requests)
            parts[mix_id] = tuple((request.lora_int_id, scale) for request, scale in part_requests)
        if mapping is None:
            original(self, kept, None)
            return
        first = {mix_id: mix_parts[0][0] for mix_id, mix_parts in parts.items()}
        rewritten = type(mapping)(
            tuple(first.get(lora_id, lora_id) for lora_id in mapping.index_mapping),
            tuple(first.get(lora_id, lora_id) for lora_id in mapping.prompt_mapping),
            mapping.is_prefill,
            mapping.type,
        )
        # Two steps with other mixes can rewrite to the same mapping: vLLM would skip the new plan.
        self._adapter_manager._last_mapping = None
        with stepping(tuple(mapping.index_mapping), parts):
            original(self, kept, rewritten)

    return set_active_adapters


def _part_request(name: str) -> Any:
    request = _requests.get(name)
    if request is None:  # the pool loads a mix's parts before the mix and keeps them while it runs
        raise RuntimeError(f"a mix's part {name!r} is not loaded on this replica")
    return request
