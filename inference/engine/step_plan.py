"""What one engine step's batch needs, worked out once per step (when vLLM updates its punica
wrapper's metadata, ``hooks.wrap_update_metadata``) instead of once per layer: the slots it uses,
the rank to compute up to, each token's (slot, scale) pairs for the C kernel, and, for torch's
batched products, the tokens arranged in groups (tiers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from inference.engine.state import RANKS, WRITES

if TYPE_CHECKING:
    import torch

    from inference.engine.mixes import StepMixes


@dataclass(frozen=True)
class Tier:
    """Tokens arranged for one batched product: ``groups`` groups of ``width`` rows, each group one
    adapter slot's, so that every token is multiplied by its own adapter only."""

    slots: (
        torch.Tensor | None
    )  # each group's slot, as an index into the step's slots; None: one group per slot, in order
    width: int
    rows: torch.Tensor  # groups*width: the token each row computes (padding repeats one; its result is never read)
    tokens: torch.Tensor | None  # the tokens this tier adds to; None: the step's first len(results) tokens, in order
    results: torch.Tensor  # for each of those tokens, its row among the tier's results
    in_order: bool  # row i is token i, every token once: no gathering either way


@dataclass
class Step:
    """What one engine step's batch needs, worked out once per step instead of once per layer."""

    slot_state: tuple[tuple[object, int], ...]  # per slot: its adapter's id and how many times it was written
    rank: int | None  # the largest rank among the adapters in the slots; None: vLLM's max_lora_rank
    slots: torch.Tensor  # LongTensor: the slots that get a group (those the batch uses, or all of them)
    all_slots: bool  # every slot gets a group: the prepared weights need no selection
    tokens: int  # the tokens vLLM scheduled (the layer's input may have padding rows past them)
    # int64, contiguous, the C kernel's input: each scheduled token's slot (-1: none); in a step with
    # mixes, tokens x parts: a mix's token has its parts' slots, weighed by ``token_weights``
    token_slots: torch.Tensor
    token_weights: torch.Tensor | None  # float32, tokens x parts: each part's scale; None: no mix
    tiers: list[Tier]  # for torch's batched products; empty when the C kernel computes

    def pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's (slot, scale) pairs as two tokens x parts tables, mixes or not."""
        import torch

        slots = self.token_slots.view(self.token_slots.size(0), -1)
        return slots, torch.ones(slots.shape) if self.token_weights is None else self.token_weights


def plan(
    indices: torch.Tensor,
    lora_index_to_id: list[int | None],
    grouped: bool,
    mixes: StepMixes | None = None,
) -> Step | None:
    """What the step's layers need: ``grouped``, for torch's batched products too (never with
    ``mixes``: those replicas build mixes as adapters)."""
    import torch

    used = indices >= 0
    if not bool(used.any()):
        return None
    slots = sorted(set(indices[used].tolist()))
    if 4 * len(slots) > len(lora_index_to_id):
        # More than a few slots: a group for every slot, the unused ones padding only, rather than a
        # copy of the used slots' weights (with many adapters in round robin the set changes at
        # nearly every step, and each change would copy them all again).
        slots = list(range(len(lora_index_to_id)))
    ranks = [RANKS.get(lora_id) for lora_id in lora_index_to_id if lora_id is not None]
    rank = max(r for r in ranks if r is not None) if all(r is not None for r in ranks) else None
    lookup = torch.full((len(lora_index_to_id),), -1, dtype=torch.long)  # slot -> its index among `slots`
    lookup[slots] = torch.arange(len(slots))
    tokens = used.nonzero().squeeze(1)
    step = Step(
        slot_state=tuple((lora_id, WRITES.get(lora_id, 0)) for lora_id in lora_index_to_id),  # type: ignore[arg-type]
        rank=rank,
        slots=torch.tensor(slots, dtype=torch.long),
        all_slots=slots == list(range(len(lora_index_to_id))),
        tokens=indices.numel(),
        token_slots=indices.to(torch.int64).contiguous(),
        token_weights=None,
        tiers=_tiers(tokens, lookup[indices[tokens]], len(slots), every_token=bool(used.all())) if grouped else [],
    )
    if mixes is not None:
        assert not grouped, "mixes are computed by the C kernel only"
        step.token_slots, step.token_weights = _mixed_pairs(step.token_slots, lora_index_to_id, mixes)
    return step


def _mixed_pairs(
    token_slots: torch.Tensor, lora_index_to_id: list[int | None], mixes: StepMixes
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (slot, scale) pairs: its own slot at scale 1, or its mix's parts' at theirs
    (vLLM's mapping pointed a mix's token at its first part's slot; ``mixes`` says which mix it was)."""
    import torch

    slot_of = {lora_id: slot for slot, lora_id in enumerate(lora_index_to_id) if lora_id is not None}
    width = max(len(parts) for parts in mixes.parts.values())
    pairs = torch.full((token_slots.numel(), width), -1, dtype=torch.int64)
    weights = torch.zeros(token_slots.numel(), width, dtype=torch.float32)
    pairs[:, 0], weights[:, 0] = token_slots, 1.0
    asked = torch.tensor(mixes.index_mapping, dtype=torch.int64)
    for mix_id, parts in mixes.parts.items():
        tokens = (asked == mix_id).nonzero().squeeze(1)
        for number, (part_id, scale) in enumerate(parts):
            pairs[tokens, number] = slot_of[part_id]
            weights[tokens, number] = scale
    return pairs, weights


def _tiers(tokens: torch.Tensor, token_slots: torch.Tensor, slots: int, every_token: bool) -> list[Tier]:
    """Arrange the adapter tokens (``token_slots``: each one's index among the step's slots) in groups.

    The first tier has one group per slot, as wide as the median slot's token count: a decode batch
    is one row per slot, and no weight is copied. The tokens past that width (the few slots that
    are prefilling a prompt) make a second tier, one group per such slot, with just their weights
    copied. Padding is at most the difference to the widest slot, within each tier.
    """
    import torch

    order = torch.argsort(token_slots, stable=True)
    tokens, token_slots = tokens[order], token_slots[order]
    counts = torch.bincount(token_slots, minlength=slots)
    within = torch.arange(tokens.numel()) - (torch.cumsum(counts, 0) - counts)[token_slots]  # place in its slot
    width = int(counts[counts > 0].median())
    first = within < width
    tiers = [
        _tier(tokens[first], token_slots[first], within[first], width, slots, None, every_token and bool(first.all()))
    ]
    if not bool(first.all()):
        over = ~first
        overflowing = torch.unique(token_slots[over])  # sorted
        group_of = torch.full((slots,), -1, dtype=torch.long)
        group_of[overflowing] = torch.arange(overflowing.numel())
        overflow_width = int((counts[overflowing] - width).max())
        tiers.append(_tier(tokens[over], group_of[token_slots[over]], within[over] - width, overflow_width,
                           overflowing.numel(), overflowing, False))
    return tiers


def _tier(
    tokens: torch.Tensor,
    groups: torch.Tensor,
    within: torch.Tensor,
    width: int,
    group_count: int,
    slots: torch.Tensor | None,
    whole: bool,
) -> Tier:
    """``groups``/``within``: each token's group and place in it. ``whole``: these are all the
    step's tokens, so results are added to its rows in order, without an indexed add."""
    import torch

    places = groups * width + within
    rows = torch.full((group_count * width,), int(tokens[0]), dtype=torch.long)
    rows[places] = tokens
    if whole:
        results = torch.empty_like(places)
        results[tokens] = places
        in_order = rows.numel() == tokens.numel() and bool(torch.equal(rows, torch.arange(rows.numel())))
        return Tier(slots, width, rows, None, results, in_order)
    return Tier(slots, width, rows, tokens, places, False)

