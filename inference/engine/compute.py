"""The LoRA of a step's projections and logits: what replaces vLLM's punica wrapper's
``add_lora_linear`` and ``add_lora_logits`` (``inference.engine.replacements``).

Each token is multiplied by its own adapter only (or its mix's parts, each at its scale), up to the
largest rank among the batch's adapters: by the C kernel (``gemv``) where it builds, by torch's
batched products over the step's groups of tokens otherwise. What the step needs was planned once
(``step_plan``); each layer's weights are prepared once (``layer_weights``). The package's docstring
says why.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from inference.engine.gemv import HalfWeights, LoraGemv, Stacked
from inference.engine.layer_weights import computed_rank, grouped_weights, layer_weights
from inference.engine.state import ADAPTS_LM_HEAD

if TYPE_CHECKING:
    import torch

    from inference.engine.step_plan import Step


def add_lora_linear(
    self: Any,
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_stacked: Stacked,
    lora_b_stacked: Stacked,
    scale: float,
    output_slices: tuple[int, ...],
    *,
    buffer: tuple[torch.Tensor, ...] | None = None,
    **kwargs: Any,
) -> None:
    step: Step | None = self._fineserve_step
    x = x.view(-1, x.shape[-1])
    if kwargs or (step is not None and x.size(0) < step.tokens):
        # An argument vLLM 0.32.0 never passed here (it may change the meaning), or fewer rows than
        # the tokens planned for: vLLM's own code.
        self._fineserve_stock_add_lora_linear(
            y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, buffer=buffer, **kwargs
        )
        return
    if step is None:  # no token in this batch uses an adapter
        return
    gemv: LoraGemv | None = self._fineserve_gemv
    if gemv is None:
        _add_grouped(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, step)
        return
    weights = layer_weights(self, lora_a_stacked, lora_b_stacked, step) if gemv.accepts(y, x) else None
    if not isinstance(weights, HalfWeights):  # not float32 row-major matrices
        if step.token_weights is None:  # vLLM's own code, which sees one adapter per token
            self._fineserve_stock_add_lora_linear(
                y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, buffer=buffer
            )
        else:  # a mix's parts, which vLLM's code would not see: torch, pair by pair
            rank = computed_rank(step, lora_a_stacked)
            _add_pairs_in_torch(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, step, step.slots.tolist(), rank)
    elif weights.fits:
        gemv.add(y, x, step.token_slots, weights, scale, step.token_weights)
    else:
        _add_unfit_apart(gemv, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, step, weights)


def _add_unfit_apart(
    gemv: LoraGemv,
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_stacked: Stacked,
    lora_b_stacked: Stacked,
    scale: float,
    output_slices: tuple[int, ...],
    step: Step,
    weights: HalfWeights,
) -> None:
    """A slot whose weights half precision cannot hold (``HalfWeights.unfit_slots``: a weight past
    65,504) is computed apart, per slot, never per batch: its tokens in float32 with torch, from
    vLLM's own weights; every other token by the C kernel, which skips a token whose slot is -1.
    (Handing the whole projection to vLLM's code would give a token without an adapter the last
    slot's adapter in its decode path.) Uploads and compositions refuse such weights; only an
    adapter stored before that check can be one."""
    import torch

    unfit = torch.tensor(sorted(weights.unfit_slots), dtype=torch.int64)
    pairs, pair_weights = step.pairs()
    kept = torch.where(torch.isin(pairs, unfit), -1, pairs).contiguous()
    gemv.add(y, x, kept, weights, scale, pair_weights.contiguous())
    _add_pairs_in_torch(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, step, weights.unfit_slots, weights.rank)


def _add_pairs_in_torch(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_stacked: Stacked,
    lora_b_stacked: Stacked,
    scale: float,
    output_slices: tuple[int, ...],
    step: Step,
    slots: Iterable[int],
    rank: int,
) -> None:
    """The step's (token, slot, scale) pairs whose slot is one of ``slots``, computed in float32
    with torch from vLLM's own weights, slot by slot: exact for any dtype and any mix, and slow."""
    pairs, pair_weights = step.pairs()
    for slot in slots:
        tokens, parts = (pairs == slot).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        rows = x.index_select(0, tokens).float() * (scale * pair_weights[tokens, parts]).unsqueeze(1)
        offset = 0
        for lora_a, lora_b, size in zip(lora_a_stacked, lora_b_stacked, output_slices):
            delta = (rows @ lora_a[slot, 0, :rank].float().t()) @ lora_b[slot, 0, :, :rank].float().t()
            y[:, offset : offset + size].index_add_(0, tokens, delta.to(y.dtype))
            offset += size


def _add_grouped(
    wrapper: Any,
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_stacked: Stacked,
    lora_b_stacked: Stacked,
    scale: float,
    output_slices: tuple[int, ...],
    step: Step,
) -> None:
    """torch's batched products over the step's groups of tokens (``step_plan``'s tiers)."""
    import torch

    shrink, expands, rank = grouped_weights(wrapper, lora_a_stacked, lora_b_stacked, step)
    for tier in step.tiers:
        tier_shrink, tier_expands = shrink, expands
        if tier.slots is not None:  # a few slots' overflow: a copy of just their weights
            tier_shrink = shrink.index_select(0, tier.slots)
            tier_expands = [expand.index_select(0, tier.slots) for expand in expands]
        groups, rows = tier_shrink.size(0), tier.rows.numel()
        grouped = x[:rows] if tier.in_order else x.index_select(0, tier.rows)
        # groups x width x (slices*rank): each row times its own slot's A, every slice at once.
        shrunk = torch.bmm(grouped.view(groups, tier.width, -1), tier_shrink)
        if scale != 1.0:
            shrunk.mul_(scale)
        offset = 0
        for index, (expand, size) in enumerate(zip(tier_expands, output_slices)):
            part = shrunk[:, :, index * rank : (index + 1) * rank]
            if tier.width > 1:
                part = part.contiguous()  # a strided left operand halves bmm's speed here
            target = y[:, offset : offset + size]
            offset += size
            if tier.in_order:
                target[:rows].view(groups, tier.width, size).baddbmm_(part, expand)
                continue
            added = torch.bmm(part, expand).view(-1, size).index_select(0, tier.results)
            if tier.tokens is None:
                target[: added.size(0)].add_(added)
            else:
                target.index_add_(0, tier.tokens, added)


def add_lora_logits(
    self: Any,
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_stacked: torch.Tensor,
    lora_b_stacked: torch.Tensor,
    scale: float,
    *,
    buffer: torch.Tensor | None = None,
    **kwargs: Any,
) -> None:
    """vLLM applies an lm_head LoRA to every step's logits, whether or not an adapter has one: on
    the CPU a per-token copy of a vocabulary-sized matrix, about 30% of SmolLM2's decode step, base
    model included (docs/lora-kernels.md). Adapters trained here never adapt lm_head (PEFT's all-linear
    leaves it out), so that delta is zero: skip it unless some slot holds a non-zero one."""
    step: Step | None = self._fineserve_step
    if not kwargs and (step is None or not _adapts_logits(self, lora_b_stacked, step)):
        return
    self._fineserve_stock_add_lora_logits(y, x, lora_a_stacked, lora_b_stacked, scale, buffer=buffer, **kwargs)


def _adapts_logits(wrapper: Any, lora_b_stacked: torch.Tensor, step: Step) -> bool:
    """Whether some slot's lm_head B is not all zero; a slot is looked at again only when vLLM puts
    another adapter in it (vLLM zeroes a slot for an adapter without lm_head weights)."""
    cache: dict[int, tuple[torch.Tensor, tuple[tuple[object, int], ...], list[bool]]] = wrapper._fineserve_logits
    entry = cache.get(id(lora_b_stacked))

    def looked_at(slot: int, lora_id: object) -> bool:
        if ADAPTS_LM_HEAD.get(lora_id) is False:  # type: ignore[call-overload]
            return False  # vLLM zeroed the slot for it: no need to read a vocabulary-sized matrix
        return bool(lora_b_stacked[slot].any())

    if entry is None or entry[0] is not lora_b_stacked:
        nonzero = [looked_at(slot, lora_id) for slot, (lora_id, _) in enumerate(step.slot_state)]
    else:
        nonzero = [
            looked_at(slot, now[0]) if now != then else known
            for slot, (now, then, known) in enumerate(zip(step.slot_state, entry[1], entry[2]))
        ]
    cache[id(lora_b_stacked)] = (lora_b_stacked, step.slot_state, nonzero)
    return any(nonzero)
