"""Faster multi-LoRA linear layers for vLLM's CPU backend (installed into the replica processes).

vLLM's CPU punica wrapper applies LoRA by gathering, for every token, a private copy of its
adapter's A and B matrices (``lora_b_weights[indices]``: tokens x out x rank) and multiplying token
by token. For a decode batch of 32 that copies about as many bytes per step as the base model's
weights, so adapters ran at a fraction of the base model's speed; it does this in the decode path
even for batches without any adapter, and a token without an adapter (index -1) picks the last
adapter slot there.

Here each projection applies the batch's adapters with dense matrix products instead: ``h = x @ A``
over the adapter slots the batch uses and all the projection's slices at once (q, k, v share one
product), a mask that keeps each token's own slot, then ``y += h @ B`` per slice. Only the slots
the batch uses are computed, and only up to the largest rank among them (vLLM pads every adapter
to ``max_lora_rank`` with zeros); the weights in that shape are prepared once and reused while the
batch's adapters stay the same; a batch without adapters skips LoRA. The arithmetic is
vLLM's reference semantics, ``y[t] += scale * x[t] @ A[i_t] @ B[i_t]``, nothing where ``i_t == -1``.

Only ``add_lora_linear`` (the projections adapters train) is replaced; embeddings and logits keep
vLLM's code. If vLLM's internals ever differ from what this expects, nothing is patched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("inference.lora_kernels")

# Rank of each loaded adapter, by vLLM's adapter id; filled when vLLM puts it in a slot. Per process.
_RANKS: dict[int, int] = {}
# Bumped whenever vLLM writes adapter weights into a slot: prepared weights from before are stale.
_generation = 0


@dataclass
class _Step:
    """What one engine step's batch needs, worked out once per step instead of once per layer."""

    key: tuple  # which weights the batch uses: layers reuse their prepared weights while it holds
    slots: object  # LongTensor: the adapter slots the batch uses
    all_slots: bool  # the batch uses every slot: the stacked weights need no selection
    rank: int | None  # the largest rank among them; None: keep vLLM's max_lora_rank
    mask: object  # tokens x len(slots) x 1: 1 where the token uses that slot


def _dense_add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None, **kwargs):
    import torch

    step: _Step | None = self._fineserve_step
    if step is None:  # no token in this batch uses an adapter
        return
    x = x.view(-1, x.shape[-1])
    tokens, used = x.size(0), step.mask.size(1)
    shrink, expands, rank = _prepared(self, lora_a_stacked, lora_b_stacked, output_slices, step)
    # One product for every slice and slot (tokens x slices*slots*rank), then only the token's own slot.
    shrunk = torch.matmul(x, shrink.t()).view(tokens, len(expands), used, rank) * _mask_rows(step, tokens, x.dtype)
    if scale != 1.0:
        shrunk = shrunk * scale
    shrunk = shrunk.view(tokens, len(expands), used * rank)
    offset = 0
    for index, (expand, size) in enumerate(zip(expands, output_slices)):
        y[:, offset : offset + size].addmm_(shrunk[:, index], expand)
        offset += size
    return


def _prepared(wrapper, lora_a_stacked, lora_b_stacked, output_slices, step: _Step):
    """The layer's weights for the slots and rank of this step, as matrices; rebuilt only when they change.

    A: slots x 1 x rank x in, one per slice, stacked into (slices*slots*rank) x in;
    B: slots x 1 x out x rank, one (slots*rank) x out matrix per slice.
    """
    cache = wrapper._fineserve_prepared
    layer = id(lora_a_stacked[0])
    entry = cache.get(layer)
    if entry is not None and entry[0] is lora_a_stacked[0] and entry[1] == step.key:
        return entry[2]
    rank = min(step.rank or lora_a_stacked[0].size(2), lora_a_stacked[0].size(2))
    used = step.mask.size(1)
    shrinks, expands = [], []
    for lora_a, lora_b, size in zip(lora_a_stacked, lora_b_stacked, output_slices):
        if not step.all_slots:
            lora_a, lora_b = lora_a.index_select(0, step.slots), lora_b.index_select(0, step.slots)
        shrinks.append(lora_a[:, 0, :rank, :].reshape(used * rank, -1))
        expands.append(lora_b[:, 0, :, :rank].transpose(1, 2).reshape(used * rank, size))
    import torch

    prepared = (torch.cat(shrinks), expands, rank)
    cache[layer] = (lora_a_stacked[0], step.key, prepared)
    return prepared


def _mask_rows(step: _Step, tokens: int, dtype):
    import torch

    if step.mask.dtype != dtype:  # built once per step, converted once per step
        step.mask = step.mask.to(dtype)
    mask = step.mask
    if mask.size(0) < tokens:  # rows past the scheduled tokens (padding) get no adapter
        mask = torch.cat([mask, mask.new_zeros((tokens - mask.size(0), *mask.shape[1:]))])
    return mask[:tokens].unsqueeze(1)  # tokens x 1 (slices) x slots x 1


def _plan(indices, lora_index_to_id: list) -> _Step | None:
    import torch

    used = indices >= 0
    if not bool(used.any()):
        return None
    slots = sorted(set(indices[used].tolist()))
    ranks = [_RANKS.get(lora_index_to_id[slot]) for slot in slots]
    rank = max(ranks) if all(rank is not None for rank in ranks) else None
    lookup = torch.full((len(lora_index_to_id) + 1,), -1, dtype=torch.long)
    lookup[slots] = torch.arange(len(slots))
    compact = lookup[indices.clamp(min=0)]
    mask = torch.nn.functional.one_hot(compact.clamp(min=0), len(slots)) * used.unsqueeze(1)
    return _Step(
        key=(_generation, tuple((slot, lora_index_to_id[slot]) for slot in slots), rank),
        slots=torch.tensor(slots, dtype=torch.long),
        all_slots=slots == list(range(len(lora_index_to_id))),
        rank=rank,
        mask=mask.unsqueeze(-1).to(torch.float32),
    )


def _wrap_update_metadata(original):
    def update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs):
        original(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs)
        self._fineserve_step = _plan(self.token_lora_indices, lora_index_to_id)

    return update_metadata


def _wrap_activate_adapter(original):
    def activate_adapter(self, lora_id: int) -> bool:
        global _generation
        activated = original(self, lora_id)
        if activated:  # just put in a slot (the original read it from _registered_adapters)
            _generation += 1
            model = self._registered_adapters[lora_id]
            layer_ranks = [layer.rank for layer in model.loras.values() if layer is not None]
            _RANKS[lora_id] = max(layer_ranks, default=model.rank)
        return activated

    return activate_adapter


def install() -> bool:
    """Patch vLLM's CPU punica wrapper in this process; True if it was patched."""
    try:
        from vllm.lora import model_manager
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:  # a GPU build, or no vLLM: nothing to speed up here
        return False
    wrapper = getattr(punica_cpu, "PunicaWrapperCPU", None)
    manager = getattr(model_manager, "LoRAModelManager", None)
    expected = (
        wrapper is not None and hasattr(wrapper, "add_lora_linear") and hasattr(wrapper, "update_metadata")
        and manager is not None and hasattr(manager, "activate_adapter")
    )  # fmt: skip
    if not expected:
        log.warning("vLLM's CPU LoRA code is not what lora_kernels expects: left as it is")
        return False
    if getattr(wrapper, "_fineserve_patched", False):
        return True
    wrapper._fineserve_step = None
    wrapper._fineserve_prepared = {}  # per layer: (its A, step key, prepared weights); shared by instances
    wrapper.update_metadata = _wrap_update_metadata(wrapper.update_metadata)
    wrapper.add_lora_linear = _dense_add_lora_linear
    manager.activate_adapter = _wrap_activate_adapter(manager.activate_adapter)
    wrapper._fineserve_patched = True
    return True
