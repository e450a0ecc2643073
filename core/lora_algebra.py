"""One LoRA adapter that equals a weighted sum of others, exactly.

A LoRA adapter adds ``k * B @ A`` to a linear layer (``A`` is rank x in, ``B`` out x rank, ``k`` its
scaling, ``lora_alpha / r``). A sum of such deltas, each with a request's scale ``s``, is again one:

    sum_i s_i * k_i * B_i @ A_i  =  [B_1 ... B_n] @ [s_1 k_1 A_1; ...; s_n k_n A_n]

so concatenating the scaled A matrices (rows) and the B matrices (columns) gives an adapter of rank
``sum r_i`` whose own scaling is 1 (``lora_alpha == r``). vLLM then serves it like any other adapter,
in the same batches; nothing is approximated (PEFT calls this ``combination_type="cat"``).

NumPy and safetensors only: the pool does not import torch. Weights are combined in float32.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from core.adapter_store import CONFIG_FILE, WEIGHTS_FILE

_LORA_A, _LORA_B = ".lora_A.weight", ".lora_B.weight"
# safetensors' dtype names -> how NumPy reads the bytes (bfloat16 as its upper 16 bits)
_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}


class CannotMix(ValueError):
    """An adapter whose form the sum does not cover; the message says what, ``folder`` which one."""

    def __init__(self, message: str, folder: Path | None = None):
        super().__init__(message)
        self.folder = folder


@dataclass(frozen=True)
class Part:
    folder: Path  # an adapter folder: adapter_config.json + adapter_model.safetensors
    scale: float


def read_config(folder: Path) -> dict:
    return json.loads((folder / CONFIG_FILE).read_text())


def rank_of(folder: Path) -> int:
    return int(read_config(folder)["r"])


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    """A safetensors file as float32 arrays (safetensors.numpy cannot read bfloat16)."""
    raw = path.read_bytes()
    header_size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_size])
    data = memoryview(raw)[8 + header_size :]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise CannotMix(f"its tensor {name} is of type {info['dtype']}")
        start, end = info["data_offsets"]
        array = np.frombuffer(data[start:end], dtype=_DTYPES[info["dtype"]]).reshape(info["shape"])
        if info["dtype"] == "BF16":
            array = (array.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = array.astype(np.float32)
    return tensors


def check_mixable_config(config: dict) -> None:
    """What the platform trains is plain LoRA on linear layers; anything else is refused by name.
    The config alone says most of it, so a composition can be refused before any weight is read."""
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):
            raise CannotMix(f"it sets {key}")
    for key in ("use_dora", "fan_in_fan_out"):
        if config.get(key):
            raise CannotMix(f"it uses {key}")
    if config.get("bias", "none") != "none":
        raise CannotMix("it trains biases")


def _check_mixable(config: dict, tensors: dict[str, np.ndarray]) -> None:
    check_mixable_config(config)
    for name in tensors:
        if not name.endswith((_LORA_A, _LORA_B)):
            raise CannotMix(f"it holds {name}, not only LoRA A and B matrices")


@dataclass(frozen=True)
class LoadedPart:
    """A part's config and weights, checked to be plain LoRA; ``scaling`` is its own ``lora_alpha / r``."""

    config: dict
    tensors: dict[str, np.ndarray]
    scale: float

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    @property
    def scaling(self) -> float:
        """PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) for rank-stabilized LoRA."""
        rank, alpha = self.rank, self.config.get("lora_alpha", 8)
        return alpha / math.sqrt(rank) if self.config.get("use_rslora") else alpha / rank

    def factors(self, module: str, fan_in: int, fan_out: int) -> tuple[np.ndarray, np.ndarray]:
        """(``scaling * A``, ``B``) of ``module``: its delta is their product. Zeros where this part
        does not adapt ``module``, so every part contributes its rank to every module."""
        if module + _LORA_A not in self.tensors:
            return np.zeros((self.rank, fan_in), np.float32), np.zeros((fan_out, self.rank), np.float32)
        return self.tensors[module + _LORA_A] * np.float32(self.scaling), self.tensors[module + _LORA_B]


def load(parts: list[Part]) -> list[LoadedPart]:
    loaded = []
    for part in parts:
        try:
            config, tensors = read_config(part.folder), read_tensors(part.folder / WEIGHTS_FILE)
            _check_mixable(config, tensors)
        except CannotMix as exc:
            raise CannotMix(str(exc), part.folder) from None
        loaded.append(LoadedPart(config, tensors, part.scale))
    return loaded


def modules_of(loaded: list[LoadedPart]) -> dict[str, tuple[int, int]]:
    """Every module some part adapts, sorted, with its (fan in, fan out)."""
    shapes = {}
    for part in loaded:
        for name, tensor in part.tensors.items():
            if name.endswith(_LORA_A):
                module = name[: -len(_LORA_A)]
                shapes[module] = (tensor.shape[1], part.tensors[module + _LORA_B].shape[0])
    return dict(sorted(shapes.items()))


def adapter_config(loaded: list[LoadedPart], modules: list[str], rank: int) -> dict:
    """The config of an adapter of ``rank`` on ``modules`` built from ``loaded``: scaling 1, as its
    weights carry every scale (each part's alpha / r, and the request's)."""
    return {
        **loaded[0].config,
        "r": rank,
        "lora_alpha": rank,
        "use_rslora": False,
        "target_modules": sorted({module.rpartition(".")[2] for module in modules}),
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def weight_names(module: str) -> tuple[str, str]:
    return module + _LORA_A, module + _LORA_B


def combine(parts: list[Part]) -> tuple[dict, dict[str, np.ndarray]]:
    """The config and weights of the one adapter equal to the sum of the scaled ``parts``.

    A module that one part adapts and another does not gets zeros for the missing part, so every
    module has the same rank, the sum of the parts' ranks.
    """
    loaded = load(parts)
    modules = modules_of(loaded)
    combined: dict[str, np.ndarray] = {}
    for module, (fan_in, fan_out) in modules.items():
        factors = [part.factors(module, fan_in, fan_out) for part in loaded]
        a_rows = [a * np.float32(part.scale) for part, (a, _) in zip(loaded, factors)]
        name_a, name_b = weight_names(module)
        combined[name_a] = np.ascontiguousarray(np.concatenate(a_rows, axis=0))
        combined[name_b] = np.ascontiguousarray(np.concatenate([b for _, b in factors], axis=1))
    rank = sum(part.rank for part in loaded)
    return adapter_config(loaded, list(modules), rank), combined


def write_adapter(config: dict, tensors: dict[str, np.ndarray], target: Path) -> Path:
    """Write an adapter folder to ``target`` atomically (built aside, then renamed), once."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        save_file(tensors, str(staging / WEIGHTS_FILE))
        (staging / CONFIG_FILE).write_text(json.dumps(config))
        try:
            staging.rename(target)
        except OSError:
            if not (target / CONFIG_FILE).is_file():  # not a twin built at the same moment
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_combined(parts: list[Part], target: Path) -> Path:
    """The combined adapter of ``parts`` at ``target``, built once."""
    if (target / CONFIG_FILE).is_file():
        return target
    return write_adapter(*combine(parts), target)
