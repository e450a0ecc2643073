"""What the pool (and Ray Serve's replicas) and the engine (``inference.engine``) agree on.

The engine is the code that runs inside vLLM's processes; the pool starts those processes, reads
what they report and writes the files they read. The two meet here, never by importing each other
(tests/test_layering.py): the server module a replica launches, the route and fields of its report,
the model dtypes its kernels compute in, and a kernel mix's manifest. Plain Python and json only:
importing this costs the pool neither vLLM nor torch. (The ``LORA_KERNELS`` setting's name and
values live in ``core.config``, which both read.)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# --- the replica's process ------------------------------------------------------------------------

# What ``inference.replica.vllm_command`` runs with ``python -m``: vLLM's OpenAI server with the
# engine's kernels (``inference.engine.server``). Tests find a replica's process by it.
SERVER_MODULE = "inference.engine.server"

# The model dtypes the engine's kernels compute in, as vLLM's --dtype spells them: a replica of a
# model in another dtype keeps vLLM's own kernels and gets mixes built as adapters.
KERNEL_DTYPES = ("float32", "float")


# --- what a replica reports: ``GET REPORT_PATH`` -------------------------------------------------

REPORT_PATH = "/fineserve/lora-kernels"
# The import path vLLM's --middleware takes for the route above (``inference.engine.report``).
REPORT_MIDDLEWARE = "inference.engine.report.LoraKernelsReport"


# --- sleep: an idle replica gives its KV cache back and keeps its process ---------------------------

SLEEP_PATH = "/fineserve/sleep"  # POST: {"asleep": true} once the engine sleeps
WAKE_PATH = "/fineserve/wake"  # POST: {"asleep": false} once it is awake
# The import path vLLM's --middleware takes for the two routes above (``inference.engine.sleep_routes``).
SLEEP_MIDDLEWARE = "inference.engine.sleep_routes.SleepRoutes"


@dataclass(frozen=True)
class KernelsState:
    """What the engine decided in its process (``inference.engine.install``); the report's body is
    these fields, which the pool shows in its /health (a replica's ``lora_kernels``) and /metrics."""

    active: str  # FINESERVE_KERNELS or STOCK_KERNELS: what computes the LoRA linear layers here
    requested: str  # the LORA_KERNELS setting
    reason: str  # why these are active; after a fall-back, what the check found
    # Whether mixes and scales are computed in the kernel (``inference.engine.mixes``): the C kernel,
    # checked with a mixed step too; otherwise the pool builds each mix as an adapter.
    mixes_in_kernel: bool = False

    @property
    def fell_back(self) -> bool:
        return self.active != self.requested


def computes_mixes(report: dict | None) -> bool:
    """Whether a replica that reported this (None: not yet) computes mixes from their parts' slots."""
    return bool((report or {}).get("mixes_in_kernel"))


# --- a kernel mix's manifest ------------------------------------------------------------------------

MANIFEST = "fineserve_mix.json"  # in a kernel mix's folder: its parts, by their names in vLLM, and scales
# A manifest is the pool's, never a tenant's (the gateway's MAX_MIX_ADAPTERS and the batch slots
# bound a mix's parts); this only keeps a broken file from becoming a huge per-token table.
_MOST_PARTS = 64


@dataclass(frozen=True)
class MixManifest:
    parts: tuple[tuple[str, float], ...]  # (adapter name in vLLM, scale)


def write_manifest(folder: Path, parts: list[tuple[str, float]]) -> None:
    """The pool writes it (``inference.adapters``); the engine reads it when vLLM loads the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {"parts": [{"adapter": name, "scale": scale} for name, scale in parts]}
    staged = folder / f".{MANIFEST}.tmp"
    staged.write_text(json.dumps(manifest))
    staged.replace(folder / MANIFEST)  # whole or absent


def read_manifest(folder: Path) -> MixManifest | None:
    """The folder's manifest; None: an adapter's folder. Raises ``ValueError`` on a broken one."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    if path.stat().st_size > 64 * 1024:
        raise ValueError(f"{MANIFEST} is larger than a mix's manifest can be")
    try:
        parts = json.loads(path.read_text())["parts"]
        manifest = MixManifest(tuple((str(part["adapter"]), float(part["scale"])) for part in parts))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{MANIFEST} is not a mix's manifest ({exc!r})") from None
    if not 0 < len(manifest.parts) <= _MOST_PARTS or not all(math.isfinite(scale) for _, scale in manifest.parts):
        raise ValueError(f"{MANIFEST} must name 1 to {_MOST_PARTS} parts with finite scales")
    return manifest
