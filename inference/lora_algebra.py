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


def _scaling(config: dict) -> float:
    """PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) for rank-stabilized LoRA."""
    rank, alpha = config["r"], config.get("lora_alpha", 8)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _check_mixable(config: dict, tensors: dict[str, np.ndarray]) -> None:
    """What the platform trains is plain LoRA on linear layers; anything else is refused by name."""
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):
            raise CannotMix(f"it sets {key}")
    for key in ("use_dora", "fan_in_fan_out"):
        if config.get(key):
            raise CannotMix(f"it uses {key}")
    if config.get("bias", "none") != "none":
        raise CannotMix("it trains biases")
    for name in tensors:
        if not name.endswith((_LORA_A, _LORA_B)):
            raise CannotMix(f"it holds {name}, not only LoRA A and B matrices")


def combine(parts: list[Part]) -> tuple[dict, dict[str, np.ndarray]]:
    """The config and weights of the one adapter equal to the sum of the scaled ``parts``.

    A module that one part adapts and another does not gets zeros for the missing part, so every
    module has the same rank, the sum of the parts' ranks.
    """
    configs, weights = [], []
    for part in parts:
        try:
            configs.append(read_config(part.folder))
            weights.append(read_tensors(part.folder / WEIGHTS_FILE))
            _check_mixable(configs[-1], weights[-1])
        except CannotMix as exc:
            raise CannotMix(str(exc), part.folder) from None
    modules = sorted({name[: -len(_LORA_A)] for tensors in weights for name in tensors if name.endswith(_LORA_A)})
    combined: dict[str, np.ndarray] = {}
    for module in modules:
        a_rows, b_columns = [], []
        present = next(tensors for tensors in weights if module + _LORA_A in tensors)
        fan_in, fan_out = present[module + _LORA_A].shape[1], present[module + _LORA_B].shape[0]
        for part, config, tensors in zip(parts, configs, weights):
            rank = config["r"]
            if module + _LORA_A in tensors:
                a_rows.append(tensors[module + _LORA_A] * np.float32(part.scale * _scaling(config)))
                b_columns.append(tensors[module + _LORA_B])
            else:
                a_rows.append(np.zeros((rank, fan_in), np.float32))
                b_columns.append(np.zeros((fan_out, rank), np.float32))
        combined[module + _LORA_A] = np.ascontiguousarray(np.concatenate(a_rows, axis=0))
        combined[module + _LORA_B] = np.ascontiguousarray(np.concatenate(b_columns, axis=1))
    rank = sum(config["r"] for config in configs)
    leaf_names = sorted({module.rpartition(".")[2] for module in modules})
    config = {
        **configs[0],
        "r": rank,
        "lora_alpha": rank,  # scaling 1: each part's alpha / r is folded into its A rows
        "use_rslora": False,
        "target_modules": leaf_names,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    return config, combined


def write_combined(parts: list[Part], target: Path) -> Path:
    """Write the combined adapter to ``target`` atomically (built aside, then renamed), once."""
    if (target / CONFIG_FILE).is_file():
        return target
    config, tensors = combine(parts)
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
