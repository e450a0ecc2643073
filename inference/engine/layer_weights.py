"""One layer's adapter weights in the layout of the kernel that computes them, prepared once per
layer and kept on the punica wrapper's class; a slot is copied again only when vLLM writes another
adapter into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inference.engine.gemv import HalfWeights, LoraGemv, Stacked

if TYPE_CHECKING:
    import torch

    from inference.engine.step_plan import Step


@dataclass
class LayerWeights:
    """One layer's adapter weights in the batched products' shape, for every slot: A as slots x in x
    (slices*rank), the slices side by side; B as one slots x rank x out per slice."""

    source: torch.Tensor  # vLLM's stacked A of the first slice: another tensor means another layer
    rank: int
    slot_state: tuple[tuple[object, int], ...]  # what was in each slot when it was copied
    shrink: torch.Tensor
    expands: list[torch.Tensor]
    stacked: tuple[Stacked, Stacked]  # vLLM's A and B, which slots are copied from again
    subset: tuple[object, torch.Tensor, list[torch.Tensor]] | None = None  # the last step's slots, when not all

    @classmethod
    def of(
        cls,
        lora_a_stacked: Stacked,
        lora_b_stacked: Stacked,
        rank: int,
        slot_state: tuple[tuple[object, int], ...],
    ) -> LayerWeights:
        import torch

        shrink = torch.cat([lora_a[:, 0, :rank, :].transpose(1, 2) for lora_a in lora_a_stacked], dim=2)
        expands = [lora_b[:, 0, :, :rank].transpose(1, 2).contiguous() for lora_b in lora_b_stacked]
        return cls(lora_a_stacked[0], rank, slot_state, shrink, expands, (lora_a_stacked, lora_b_stacked))

    def copy_slots(self, slots: list[int]) -> None:
        """Copy these slots again from vLLM's layout."""
        rank, (lora_a_stacked, lora_b_stacked) = self.rank, self.stacked
        for slot in slots:
            for number, (lora_a, lora_b) in enumerate(zip(lora_a_stacked, lora_b_stacked)):
                self.shrink[slot, :, number * rank : (number + 1) * rank].copy_(lora_a[slot, 0, :rank, :].t())
                self.expands[number][slot].copy_(lora_b[slot, 0, :, :rank].t())
        self.subset = None


def computed_rank(step: Step, lora_a_stacked: Stacked) -> int:
    """The rank a layer is computed to in this step: its adapters' largest, at most vLLM's slots'."""
    max_rank = lora_a_stacked[0].size(2)
    return min(step.rank or max_rank, max_rank)


def layer_weights(
    wrapper: Any,
    lora_a_stacked: Stacked,
    lora_b_stacked: Stacked,
    step: Step,
) -> LayerWeights | HalfWeights | None:
    """The layer's adapter weights in the layout of the wrapper's kernel, prepared once and computed
    up to the step's rank; None: the C kernel cannot read vLLM's (not float32 in host memory). A
    slot is copied again only when vLLM writes another adapter into it, so a batch whose adapters
    change every step (many adapters in round robin) costs one slot's copy per change, not all."""
    cache: dict[int, LayerWeights | HalfWeights] = wrapper._fineserve_prepared
    gemv: LoraGemv | None = wrapper._fineserve_gemv
    layer = id(lora_a_stacked[0])
    rank = computed_rank(step, lora_a_stacked)
    weights = cache.get(layer)
    if weights is None or weights.source is not lora_a_stacked[0] or weights.rank != rank:
        if gemv is not None and not gemv.reads(*lora_a_stacked, *lora_b_stacked):
            return None
        prepare = LayerWeights.of if gemv is None else gemv.prepare
        weights = cache[layer] = prepare(lora_a_stacked, lora_b_stacked, rank, step.slot_state)
    elif weights.slot_state != step.slot_state:
        changed = [slot for slot, (now, then) in enumerate(zip(step.slot_state, weights.slot_state)) if now != then]
        weights.copy_slots(changed)
        weights.slot_state = step.slot_state
    return weights


def grouped_weights(
    wrapper: Any,
    lora_a_stacked: Stacked,
    lora_b_stacked: Stacked,
    step: Step,
) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """The batched products' weights for the slots of this step, and the rank they are computed to."""
    weights = layer_weights(wrapper, lora_a_stacked, lora_b_stacked, step)
    assert isinstance(weights, LayerWeights)
    if step.all_slots:
        return weights.shrink, weights.expands, weights.rank
    key = tuple(step.slots.tolist())
    if weights.subset is None or weights.subset[0] != key:
        expands = [expand.index_select(0, step.slots) for expand in weights.expands]
        weights.subset = (key, weights.shrink.index_select(0, step.slots), expands)
    return weights.subset[1], weights.subset[2], weights.rank
