"""Is an adapter trained elsewhere one the platform can serve on a base model? A PEFT LoRA whose
every tensor fits the base model's layers, within the catalog's rank limit.

Reads ``adapter_config.json`` and only the header of ``adapter_model.safetensors`` (names, dtypes,
shapes: ``safe_open`` checks the header against the file and loads no tensor, and safetensors can
hold no pickle). The base model's shapes come from the ``config.json`` in its weights folder.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from core.adapter_store import CONFIG_FILE, WEIGHTS_FILE
from core.api_errors import invalid_adapter
from core.catalog import BaseModel

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
DTYPES = ("F16", "BF16", "F32")
# PEFT's names for a LoRA on a causal LM's decoder layer: base_model.model.model.layers.<i>.<block>.<module>.lora_<A|B>.weight
_TENSOR = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# Config features a served LoRA cannot have: vLLM loads plain low-rank pairs on the linear layers.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layer_replication": "layer replication (layer_replication)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
}


@dataclass(frozen=True)
class Architecture:
    """The shapes of a decoder's linear layers (Llama's layout: q/k/v/o and gate/up/down)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    def linear(self, module: str) -> tuple[int, int]:
        """(in features, out features) of ``module``."""
        attention = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return {
            "q_proj": (self.hidden, attention),
            "k_proj": (self.hidden, kv),
            "v_proj": (self.hidden, kv),
            "o_proj": (attention, self.hidden),
            "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }[module]


def architecture(weights: Path) -> Architecture:
    config = json.loads((weights / "config.json").read_text())
    heads = config["num_attention_heads"]
    return Architecture(
        layers=config["num_hidden_layers"], hidden=config["hidden_size"], intermediate=config["intermediate_size"],
        heads=heads, kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
    )  # fmt: skip


@dataclass(frozen=True)
class CheckedAdapter:
    rank: int
    target_modules: tuple[str, ...]


def check_adapter(folder: Path, base: BaseModel) -> CheckedAdapter:
    """Refuse (``invalid_adapter``, naming the problem) anything but a LoRA that fits ``base``."""
    config = _config(folder / CONFIG_FILE)
    rank = _rank(config, base)
    targets = _target_modules(config)
    _check_tensors(folder / WEIGHTS_FILE, architecture(base.weights), base.id, rank, targets)
    return CheckedAdapter(rank, targets)


def served_config(folder: Path, base_model_id: str) -> None:
    """Name the base model as the platform serves it, so vLLM's check and PEFT both accept it."""
    path = folder / CONFIG_FILE
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = base_model_id
    path.write_text(json.dumps(config, indent=2))


def _config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid_adapter(f"{CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise invalid_adapter(f"{CONFIG_FILE} must hold a JSON object")
    if config.get("peft_type") != "LORA":
        raise invalid_adapter(f"peft_type is {config.get('peft_type')!r}; only LoRA adapters (\"LORA\") are accepted")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise invalid_adapter(f"the adapter uses {what}, which the inference engine cannot serve")
    return config


def _rank(config: dict[str, Any], base: BaseModel) -> int:
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise invalid_adapter(f"r (the LoRA rank) must be a positive whole number, not {rank!r}")
    if rank > base.lora.max_lora_rank:
        raise invalid_adapter(f"its rank r={rank} is larger than {base.id}'s max_lora_rank of {base.lora.max_lora_rank}")
    return rank


def _target_modules(config: dict[str, Any]) -> tuple[str, ...]:
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise invalid_adapter(f"target_modules must be a list of module names, not {targets!r}")
    unknown = sorted(set(targets) - set(ATTENTION + MLP))
    if unknown:
        raise invalid_adapter(f"target_modules {unknown} are not linear layers of the base model; choose from {list(ATTENTION + MLP)}")
    return tuple(targets)


def _check_tensors(path: Path, arch: Architecture, base_id: str, rank: int, targets: tuple[str, ...]) -> None:
    try:
        with safe_open(str(path), framework="numpy") as weights:
            shapes = {name: (weights.get_slice(name).get_shape(), weights.get_slice(name).get_dtype()) for name in weights.keys()}
    except Exception as exc:  # safetensors raises its own error types for a bad header
        raise invalid_adapter(f"{WEIGHTS_FILE} is not a readable safetensors file ({exc})") from None
    if not shapes:
        raise invalid_adapter(f"{WEIGHTS_FILE} holds no tensors")
    pairs: dict[tuple[int, str], set[str]] = {}
    for name, (shape, dtype) in sorted(shapes.items()):
        match = _TENSOR.fullmatch(name)
        if match is None:
            raise invalid_adapter(f"the tensor {name} is not a LoRA weight of a decoder layer's linear module")
        layer, block, module, half = int(match[1]), match[2], match[3], match[4]
        if module not in (ATTENTION if block == "self_attn" else MLP) or module not in targets:
            raise invalid_adapter(f"the tensor {name} is for {block}.{module}, not one of target_modules {list(targets)}")
        if layer >= arch.layers:
            raise invalid_adapter(f"the tensor {name} is for layer {layer}; {base_id} has {arch.layers} layers (0 to {arch.layers - 1})")
        if dtype not in DTYPES:
            raise invalid_adapter(f"the tensor {name} is {dtype}; only float16, bfloat16 and float32 are accepted")
        in_features, out_features = arch.linear(module)
        expected = [rank, in_features] if half == "A" else [out_features, rank]
        if list(shape) != expected:
            raise invalid_adapter(
                f"the tensor {name} has shape {list(shape)}; {base_id} with r={rank} needs {expected} "
                "(is it an adapter of another base model?)"
            )
        pairs.setdefault((layer, module), set()).add(half)
    for (layer, module), halves in sorted(pairs.items()):
        if halves != {"A", "B"}:
            missing = "lora_B" if "A" in halves else "lora_A"
            raise invalid_adapter(f"layer {layer}'s {module} has no {missing} weight")
