"""Small LoRA adapter folders written with torch (random weights of a fixed seed, any rank, alpha
and modules of one layer), and the delta PEFT computes from one: for the tests of mixes and merges."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from core.lora_algebra import read_tensors

PREFIX = "base_model.model.model.layers.0"
FAN_IN, FAN_OUT = 12, 10


def _adapter(folder: Path, seed: int, rank: int, alpha: int, modules: list[str], dtype=torch.float32, **config) -> Path:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module in modules:
        tensors[f"{PREFIX}.{module}.lora_A.weight"] = torch.randn(rank, FAN_IN, generator=generator).to(dtype)
        tensors[f"{PREFIX}.{module}.lora_B.weight"] = torch.randn(FAN_OUT, rank, generator=generator).to(dtype)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    settings = {"r": rank, "lora_alpha": alpha, "target_modules": modules, "base_model_name_or_path": "base"}
    (folder / "adapter_config.json").write_text(json.dumps(settings | config))
    return folder


def _delta(folder: Path, module: str) -> np.ndarray:
    """What an adapter adds to a module's weight, as PEFT computes it: scaling * B @ A."""
    config = json.loads((folder / "adapter_config.json").read_text())
    tensors = read_tensors(folder / "adapter_model.safetensors")
    key = f"{PREFIX}.{module}.lora_"
    if key + "A.weight" not in tensors:
        return np.zeros((FAN_OUT, FAN_IN))
    scaling = config["lora_alpha"] / (config["r"] ** 0.5 if config.get("use_rslora") else config["r"])
    return scaling * tensors[key + "B.weight"].astype(np.float64) @ tensors[key + "A.weight"]
