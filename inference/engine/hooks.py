"""Wrappers around vLLM's methods that keep what the kernels read, each calling vLLM's own first:
the step's plan (``wrap_update_metadata``), what an adapter is once vLLM puts it in a slot
(``wrap_activate_adapter``: its rank, its writes, whether it has lm_head weights), adapters held in
half precision (``wrap_add_adapter``), and vocabulary-sized slots zeroed once (``wrap_reset_lora``,
``wrap_set_lora``). Which vLLM class each wraps, and when: ``inference.engine.replacements``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from core.adapter_check import HALF_MAX
from inference.engine.mixes import step_mixes
from inference.engine.state import ADAPTS_LM_HEAD, RANKS, WRITES
from inference.engine.step_plan import plan

if TYPE_CHECKING:
    import torch

log = logging.getLogger("inference.engine.hooks")


def wrap_update_metadata(original: Callable[..., None]) -> Callable[..., None]:
    def update_metadata(
        self: Any, mapping: Any, lora_index_to_id: list[int | None], max_loras: int, vocab_size: int, **kwargs: Any
    ) -> None:
        original(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs)
        mixes = step_mixes(mapping.index_mapping)
        grouped = self._fineserve_gemv is None
        self._fineserve_step = plan(self.token_lora_indices, lora_index_to_id, grouped, mixes)

    return update_metadata


def wrap_activate_adapter(original: Callable[[Any, int], bool]) -> Callable[[Any, int], bool]:
    def activate_adapter(self: Any, lora_id: int) -> bool:
        activated = original(self, lora_id)
        if activated:  # just put in a slot (the original read it from _registered_adapters)
            WRITES[lora_id] = WRITES.get(lora_id, 0) + 1
            ADAPTS_LM_HEAD[lora_id] = _adapts_lm_head(self, lora_id)
            rank = _adapter_rank(self, lora_id)
            if rank is None:  # computed up to max_lora_rank: slower, still right
                RANKS.pop(lora_id, None)
            else:
                RANKS[lora_id] = rank
        return activated

    return activate_adapter


def wrap_add_adapter(original: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    def _add_adapter(self: Any, lora: Any) -> None:
        original(self, lora)  # merges q/k/v and folds each scaling into B: the weights as served
        _hold_in_half(lora)

    return _add_adapter


def _hold_in_half(lora: Any) -> None:
    """Keep a registered adapter's weights in half precision, as the C kernel reads them: half the
    host memory, so the warm tier holds twice the adapters, and a slot swap reads half the bytes.
    vLLM's copy into a slot converts them back (exactly). An adapter with a weight past half
    precision's range stays in float32 (``HalfWeights.unfit_slots`` computes it apart)."""
    import torch

    tensors = [tensor for layer in lora.loras.values() for tensor in _weights_of(layer)]
    if any(tensor.dtype != torch.float32 or not bool(tensor.abs().max() <= HALF_MAX) for tensor in tensors):
        return
    for layer in lora.loras.values():
        for name in ("lora_a", "lora_b"):
            value = getattr(layer, name)  # a tensor, or a packed layer's list of them (None: no such part)
            if isinstance(value, list):
                setattr(layer, name, [None if tensor is None else tensor.half() for tensor in value])
            elif value is not None:
                setattr(layer, name, value.half())


def _weights_of(layer: Any) -> list[torch.Tensor]:
    found = []
    for name in ("lora_a", "lora_b"):
        value = getattr(layer, name)
        found += [tensor for tensor in (value if isinstance(value, list) else [value]) if tensor is not None]
    return found


def _adapts_lm_head(manager: Any, lora_id: int) -> bool:
    """Whether the adapter has lm_head weights; True (look at its slot) when vLLM keeps them elsewhere."""
    try:
        return any("lm_head" in name for name in manager._registered_adapters[lora_id].loras)
    except (AttributeError, KeyError, TypeError):
        return True


def wrap_reset_lora(original: Callable[[Any, int], None]) -> Callable[[Any, int], None]:
    """vLLM zeroes a vocabulary-sized slot (the embeddings' and the logits' LoRA: 3 MB each for this
    catalog's model) whenever an adapter without such weights, as every servable one is, takes the
    slot: a slot zeroed since anything was written to it is left as it is."""

    def reset_lora(self: Any, index: int) -> None:
        zeroed: set[int] = self.__dict__.setdefault("_fineserve_zeroed", set())
        if index in zeroed:
            return
        original(self, index)
        zeroed.add(index)

    return reset_lora


def wrap_set_lora(original: Callable[..., None]) -> Callable[..., None]:
    def set_lora(self: Any, index: int, lora_a: Any, lora_b: Any) -> None:
        original(self, index, lora_a, lora_b)  # zeroes the slot first (``wrap_reset_lora``), then writes it
        self.__dict__.setdefault("_fineserve_zeroed", set()).discard(index)

    return set_lora


def _adapter_rank(manager: Any, lora_id: int) -> int | None:
    """The largest rank among the adapter's layers; None if vLLM no longer keeps them where 0.32.0 did."""
    try:
        model = manager._registered_adapters[lora_id]
        layer_ranks = [layer.rank for layer in model.loras.values() if layer is not None]
        return int(max(layer_ranks, default=model.rank))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        log.warning(
            "LoRA kernels: adapter %s's rank is not where vLLM 0.32.0 kept it (%r): using max_lora_rank", lora_id, exc
        )
        return None
