"""Before our CPU LoRA kernels replace vLLM's, check that vLLM is still what they were written for.

A vLLM upgrade could otherwise break them in two ways that nothing else would catch in time: a
replaced method that now takes other arguments raises on every engine step (the engine dies, its
model answers 503 for ever), and a changed tensor layout computes wrong tokens without any error.
So, at a replica's start, before its engine serves (milliseconds, on small tensors):

- signatures: each replaced method takes exactly the parameters (names and kinds) of its
  replacement;
- one known answer: a small batch (several adapter slots of different ranks, tokens of mixed slots
  and without an adapter, three output slices, a scale other than 1) goes through vLLM's own
  ``update_metadata`` and ``add_lora_linear`` and through ours, as prefill and as decode, and the
  results must agree; so must ``add_lora_logits``'s, with and without an lm_head delta.

``refusal`` says why not, or None. It imports nothing of ours: ``inference.engine.install`` passes in
what it would patch (the rows of ``inference.engine.replacements`` that apply).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from inference.engine.replacements import Replacement


def refusal(
    replacements: list[Replacement], stock_wrapper: type, patched_wrapper: type, ranks: MutableMapping[int, int]
) -> str | None:
    """Why vLLM's own kernels must stay, or None. ``patched_wrapper``: a subclass of vLLM's punica
    wrapper with our methods; ``ranks``: where ours look up adapter ranks (seeded for the step)."""
    return signature_refusal(replacements) or known_answer_refusal(stock_wrapper, patched_wrapper, ranks)


# --- signatures ----------------------------------------------------------------------------------


def _parameters(function: Callable[..., Any]) -> list[inspect.Parameter]:
    """Names and kinds, what a call depends on; annotations and defaults aside."""
    return [inspect.Parameter(p.name, p.kind) for p in inspect.signature(function).parameters.values()]


def _shown(parameters: list[inspect.Parameter]) -> str:
    return str(inspect.Signature(parameters))


def signature_refusal(replacements: list[Replacement]) -> str | None:
    for replacement in replacements:
        where = f"{replacement.owner.__name__}.{replacement.name}"
        original = getattr(replacement.owner, replacement.name, None)
        if original is None:
            return f"vLLM's {where} is gone"
        try:
            theirs, ours = _parameters(original), _parameters(replacement.new)
        except (TypeError, ValueError) as exc:
            return f"vLLM's {where} has no readable signature ({exc})"
        if theirs != ours:
            return f"vLLM's {where} now takes {_shown(theirs)}, not the {_shown(ours)} our kernels replace"
    return None


# --- one known answer ----------------------------------------------------------------------------

_FAN_IN = 64
_SLICES = (48, 16, 16)  # output slices, as a fused q/k/v projection has
_MAX_RANK = 16  # vLLM pads every adapter to max_lora_rank with zeros
_ADAPTERS = {9001: 8, 9002: 16, 9003: 4}  # vLLM adapter id -> rank, in slots 0, 1 and 2
# Slot 3 stays empty, as vLLM leaves a free slot zeroed: vLLM 0.32.0's CPU kernel reads the last
# slot for a token without an adapter, ours reads nothing; the two agree only while it is empty.
_SLOTS = 4
# Each token's slot; -1: no adapter. Slot 0 has more tokens than the others (as a prompt being
# prefilled has), which our kernel computes in a second tier.
_TOKENS = (0, 1, -1, 2, 2, 0, -1, 1, 1, 0, 0, 0)
_SCALE = 0.5
_VOCAB = 40  # the logits' width
# Relative to the batch's largest value: our C kernel holds adapter weights in half precision (each
# rounded by at most 2^-11), and the orders of summation differ; a wrong layout, slot or scale is off
# by a whole adapter's delta, hundreds of times more.
_TOLERANCE = 2e-3


def _agree(got: torch.Tensor, expected: torch.Tensor) -> bool:
    import torch

    bound = _TOLERANCE * float(expected.abs().max())
    return got.shape == expected.shape and torch.allclose(got, expected, rtol=_TOLERANCE, atol=bound)


@dataclass(frozen=True)
class _Batch:
    x: torch.Tensor
    y: torch.Tensor  # the base layer's output, which LoRA adds to
    lora_a: tuple[torch.Tensor, ...]
    lora_b: tuple[torch.Tensor, ...]


def _batch() -> _Batch:
    import torch

    generator = torch.Generator().manual_seed(0)
    lora_a = tuple(torch.zeros(_SLOTS, 1, _MAX_RANK, _FAN_IN) for _ in _SLICES)
    lora_b = tuple(torch.zeros(_SLOTS, 1, size, _MAX_RANK) for size in _SLICES)
    for slot, rank in enumerate(_ADAPTERS.values()):
        for a, b in zip(lora_a, lora_b):
            a[slot, 0, :rank] = torch.randn(rank, _FAN_IN, generator=generator)
            b[slot, 0, :, :rank] = torch.randn(b.shape[2], rank, generator=generator)
    x = torch.randn(len(_TOKENS), _FAN_IN, generator=generator)
    y = torch.randn(len(_TOKENS), sum(_SLICES), generator=generator)
    return _Batch(x, y, lora_a, lora_b)


def updated_wrapper(
    wrapper_class: type, token_slots: Sequence[int], slot_ids: list[int | None], is_prefill: bool, vocab_size: int = 32
) -> Any:
    """A punica wrapper after vLLM's ``update_metadata`` for a batch whose tokens use these slots
    (-1: no adapter), called as vLLM's model manager calls it."""
    from vllm.lora.layers import LoRAMapping

    lora_ids = tuple((slot_ids[slot] or 0) if slot >= 0 else 0 for slot in token_slots)  # 0: no adapter
    wrapper = wrapper_class(max_num_batched_tokens=len(token_slots), max_batches=len(token_slots), device="cpu")
    mapping = LoRAMapping(index_mapping=lora_ids, prompt_mapping=lora_ids, is_prefill=is_prefill)
    wrapper.update_metadata(mapping, slot_ids, len(slot_ids) + 1, vocab_size)  # max_loras: slots + 1, as vLLM passes it
    return wrapper


def _step(wrapper_class: type, batch: _Batch, is_prefill: bool) -> torch.Tensor:
    """One layer's LoRA in one engine step, called as vLLM's linear layers call it."""
    wrapper = updated_wrapper(wrapper_class, _TOKENS, [*_ADAPTERS, None], is_prefill)
    y = batch.y.clone()
    wrapper.add_lora_linear(y, batch.x, batch.lora_a, batch.lora_b, _SCALE, _SLICES)
    return y


def _logits_step(wrapper_class: type, batch: _Batch, lm_head_slot: int | None) -> torch.Tensor:
    """The logits' LoRA in one decode step, with a non-zero lm_head delta in ``lm_head_slot`` only."""
    import torch

    wrapper = updated_wrapper(wrapper_class, _TOKENS, [*_ADAPTERS, None], False, _VOCAB)
    lora_a = batch.lora_a[0]  # slots x 1 x rank x in
    lora_b = torch.zeros(_SLOTS, 1, _VOCAB, _MAX_RANK)
    if lm_head_slot is not None:
        lora_b[lm_head_slot, 0] = torch.randn(_VOCAB, _MAX_RANK, generator=torch.Generator().manual_seed(1))
    y = torch.randn(len(_TOKENS), _VOCAB, generator=torch.Generator().manual_seed(2))
    wrapper.add_lora_logits(y, batch.x, lora_a, lora_b, 1.0)
    return y


def known_answer_refusal(stock_wrapper: type, patched_wrapper: type, ranks: MutableMapping[int, int]) -> str | None:
    import torch

    seeded = [lora_id for lora_id in _ADAPTERS if lora_id not in ranks]
    ranks.update({lora_id: _ADAPTERS[lora_id] for lora_id in seeded})
    try:
        batch = _batch()
        # Logits: ours skip vLLM's lm_head LoRA while every slot's delta is zero, and run it otherwise.
        for lm_head_slot in (None, 1):
            try:
                expected = _logits_step(stock_wrapper, batch, lm_head_slot)
                got = _logits_step(patched_wrapper, batch, lm_head_slot)
            except Exception as exc:
                return f"the logits' known-answer step failed on this vLLM: {exc!r}"
            if not _agree(got, expected):
                return f"the logits' known-answer step (lm_head delta in slot {lm_head_slot}) differs from vLLM's own"
        for is_prefill in (True, False):
            phase = "prefill" if is_prefill else "decode"
            try:
                expected = _step(stock_wrapper, batch, is_prefill)
            except Exception as exc:  # any failure means: not the vLLM we know
                return f"vLLM's own kernel failed the known-answer step ({phase}): {exc!r}"
            try:
                got = _step(patched_wrapper, batch, is_prefill)
            except Exception as exc:
                return f"our kernel failed the known-answer step ({phase}) on this vLLM: {exc!r}"
            if not _agree(got, expected):
                worst = (got - expected).abs().max().item() if got.shape == expected.shape else float("nan")
                return f"our kernel's known-answer step ({phase}) differs from vLLM's own by up to {worst:.3g}"
            if torch.equal(got, batch.y):
                return f"the known-answer step ({phase}) added nothing: no adapter reached the layer"
    finally:
        for lora_id in seeded:
            ranks.pop(lora_id, None)
    return None


# --- a mixed step ----------------------------------------------------------------------------------

# Mixes (``inference.engine.mixes``): vLLM adapter id -> its parts' ids and scales. Ids as vLLM's
# mapping carries them, 0: no adapter. One mix of two parts at scales other than 1 (one negative),
# one adapter alone at a scale: what a request's ``adapters`` asks for.
_MIXES = {9100: ((9001, 0.75), (9003, -1.25)), 9101: ((9002, 2.5),)}
_MIXED_TOKENS = (9100, 9001, 0, 9101, 9100, 9002, 9101, 0, 9003, 9100, 9100, 9100)


def mix_refusal(
    stock_wrapper: type, patched_wrapper: type, ranks: MutableMapping[int, int], stepping: Callable[..., Any]
) -> str | None:
    """Why mixes cannot be computed in our kernel here, or None: a batch of plain, mixed and scaled
    tokens and tokens without an adapter, through ours (as ``inference.engine.mixes`` sets the step up,
    ``stepping`` its context), against the sum of vLLM's own kernel's deltas, one per (slot, scale)."""
    seeded = [lora_id for lora_id in _ADAPTERS if lora_id not in ranks]
    ranks.update({lora_id: _ADAPTERS[lora_id] for lora_id in seeded})
    slot_ids: list[int | None] = [*_ADAPTERS, None]
    slot_of = {lora_id: slot for slot, lora_id in enumerate(slot_ids) if lora_id is not None}
    first = {mix_id: parts[0][0] for mix_id, parts in _MIXES.items()}
    pointed = [slot_of[first.get(lora_id, lora_id)] if lora_id else -1 for lora_id in _MIXED_TOKENS]
    try:
        batch = _batch()
        for is_prefill in (True, False):
            phase = "prefill" if is_prefill else "decode"
            try:
                expected = _mixed_expected(stock_wrapper, batch, slot_of, is_prefill)
            except Exception as exc:
                return f"vLLM's own kernel failed the mixed known-answer step ({phase}): {exc!r}"
            try:
                with stepping(_MIXED_TOKENS, dict(_MIXES)):
                    wrapper = updated_wrapper(patched_wrapper, pointed, slot_ids, is_prefill)
                got = batch.y.clone()
                wrapper.add_lora_linear(got, batch.x, batch.lora_a, batch.lora_b, _SCALE, _SLICES)
            except Exception as exc:
                return f"our kernel failed the mixed known-answer step ({phase}): {exc!r}"
            if not _agree(got, expected):
                worst = (got - expected).abs().max().item() if got.shape == expected.shape else float("nan")
                return f"our kernel's mixed known-answer step ({phase}) differs from vLLM's own by up to {worst:.3g}"
    finally:
        for lora_id in seeded:
            ranks.pop(lora_id, None)
    return None


def _mixed_expected(stock_wrapper: type, batch: _Batch, slot_of: dict[int, int], is_prefill: bool) -> torch.Tensor:
    """The batch's output from vLLM's own kernel: one pass per distinct scale, each token's part of
    that scale (if any) in its slot and the others none, the passes' deltas summed."""
    pairs = [
        _MIXES.get(lora_id, ((lora_id, 1.0),)) if lora_id else () for lora_id in _MIXED_TOKENS
    ]  # each token's (adapter id, scale)
    expected = batch.y.clone()
    for scale in sorted({scale for token in pairs for _, scale in token}):
        for position in range(max(len(token) for token in pairs)):
            slots = [
                slot_of[token[position][0]] if position < len(token) and token[position][1] == scale else -1
                for token in pairs
            ]
            if all(slot < 0 for slot in slots):
                continue
            wrapper = updated_wrapper(stock_wrapper, slots, [*_ADAPTERS, None], is_prefill)
            y = batch.y.clone()
            wrapper.add_lora_linear(y, batch.x, batch.lora_a, batch.lora_b, _SCALE * scale, _SLICES)
            expected += y - batch.y
    return expected
