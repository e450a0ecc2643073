"""Faster multi-LoRA linear layers for vLLM's CPU backend (installed into the replica processes).

vLLM's CPU punica wrapper applies LoRA by gathering, for every token, a private copy of its
adapter's A and B matrices (``lora_b_weights[indices]``: tokens x out x rank) and multiplying token
by token. For a decode batch of 32 that copies about as many bytes per step as the base model's
weights, which is why adapters ran at about half the base model's speed here; it also runs for
batches that hold no adapter at all, and a token without an adapter (index -1) silently picks the
last adapter slot in the decode path.

Here every adapter slot is applied with two dense matrix products per projection instead:
``h = x @ A_all`` (all slots at once: tokens x slots*rank, rank is small), a mask that keeps each
token's own slot, then ``y += h @ B_all``. The weights are read once per step, not once per token,
and a batch without adapters skips LoRA entirely. Same arithmetic as vLLM's reference semantics:
``y[t] += scale * x[t] @ A[i_t] @ B[i_t]``, with nothing added where ``i_t == -1``.

Only ``add_lora_linear`` (the projections adapters train) is replaced; embeddings and logits keep
vLLM's code. If vLLM's internals ever differ from what this expects, nothing is patched.
"""

from __future__ import annotations

import logging

log = logging.getLogger("inference.lora_kernels")


def _dense_add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None, **kwargs):
    import torch

    x = x.view(-1, x.shape[-1])
    mask = _mask_for(self, x.size(0), x.dtype)
    if mask is None:  # no token in this batch uses an adapter
        return None
    tokens = x.size(0)
    offset = 0
    for lora_a, lora_b, size in zip(lora_a_stacked, lora_b_stacked, output_slices):
        slots, _, rank, fan_in = lora_a.shape
        # tokens x (slots*rank): every slot's shrink in one product, then only the token's own slot.
        shrunk = torch.matmul(x, lora_a.view(slots * rank, fan_in).t())
        shrunk = (shrunk.view(tokens, slots, rank) * mask[:, :slots]).view(tokens, slots * rank)
        if scale != 1.0:
            shrunk = shrunk * scale
        # B is stored slots x out x rank; as (slots*rank) x out it is one product for all slots.
        expand = lora_b.view(slots, size, rank).transpose(1, 2).reshape(slots * rank, size)
        y[:, offset : offset + size] += torch.matmul(shrunk, expand)
        offset += size
    return None


def _mask_for(wrapper, tokens: int, dtype):
    """tokens x slots x 1: 1 where the token uses that slot; None when no token uses any slot."""
    import torch

    mask = wrapper._fineserve_slot_mask
    if mask is None:
        return None
    if mask.dtype != dtype:  # built once per step, converted once per step
        mask = wrapper._fineserve_slot_mask = mask.to(dtype)
    if mask.size(0) < tokens:  # rows past the scheduled tokens (padding) get no adapter
        mask = torch.cat([mask, mask.new_zeros((tokens - mask.size(0), *mask.shape[1:]))])
    return mask[:tokens]


def _wrap_update_metadata(original):
    def update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs):
        import torch

        original(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs)
        indices = self.token_lora_indices
        used = indices >= 0
        if bool(used.any()):
            # max_loras here counts one slot more than the weights hold; layers use the first ones.
            one_hot = torch.nn.functional.one_hot(indices.clamp(min=0), max_loras) * used.unsqueeze(1)
            self._fineserve_slot_mask = one_hot.unsqueeze(-1).to(torch.float32)
        else:
            self._fineserve_slot_mask = None

    return update_metadata


def install() -> bool:
    """Patch vLLM's CPU punica wrapper in this process; True if it was patched."""
    try:
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:  # a GPU build, or no vLLM: nothing to speed up here
        return False
    wrapper = getattr(punica_cpu, "PunicaWrapperCPU", None)
    if wrapper is None or not hasattr(wrapper, "add_lora_linear") or not hasattr(wrapper, "update_metadata"):
        log.warning("vLLM's CPU LoRA wrapper is not what lora_kernels expects: left as it is")
        return False
    if getattr(wrapper, "_fineserve_patched", False):
        return True
    wrapper._fineserve_slot_mask = None
    wrapper.update_metadata = _wrap_update_metadata(wrapper.update_metadata)
    wrapper.add_lora_linear = _dense_add_lora_linear
    wrapper._fineserve_patched = True
    return True
