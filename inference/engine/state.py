"""What the engine keeps per process: what was decided (``KernelsState``) and what it learns of the
adapters as vLLM puts them in slots (written by ``inference.engine.hooks``, read by the plan and the
kernels). Each of vLLM's processes has its own: the server's decides and reports, the engine's worker
decides alike and computes.
"""

from __future__ import annotations

from collections.abc import Callable

from core.config import STOCK_KERNELS
from inference.engine_contract import KernelsState

# Rank of each loaded adapter, by vLLM's adapter id; filled when vLLM puts it in a slot.
RANKS: dict[int, int] = {}
# How many times vLLM wrote each adapter into a slot, by adapter id: a slot's prepared weights are
# stale once another adapter, or the same one written again, is in it.
WRITES: dict[int, int] = {}
# Whether each loaded adapter has lm_head weights, by adapter id (known when vLLM puts it in a slot):
# the logits' LoRA need not look at a slot whose adapter has none (``compute.add_lora_logits``).
ADAPTS_LM_HEAD: dict[int, bool] = {}

_decided: KernelsState | None = None


def decided_once(decide: Callable[[], KernelsState]) -> KernelsState:
    """What ``decide`` says the first time in this process; the same thereafter."""
    global _decided
    if _decided is None:
        _decided = decide()
    return _decided


def state() -> KernelsState:
    """What runs in this process; vLLM's own kernels if nothing was decided (vLLM's stock server)."""
    return _decided or KernelsState(STOCK_KERNELS, STOCK_KERNELS, "vLLM's server without inference.engine.server")
