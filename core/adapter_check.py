"""Is an adapter trained elsewhere one the platform can serve on a base model? A PEFT LoRA whose
every tensor fits the base model's layers, within the catalog's rank limit, with a config whose
every field has the type and range PEFT gives it, and weights the inference engine can hold.

Reads ``adapter_config.json`` (small, flat, every number finite) and ``adapter_model.safetensors``:
its header (names, dtypes, shapes: ``safe_open`` checks the header against the file, and
safetensors can hold no pickle), then its values a slice at a time (``check_weight_values``): each
finite, and within half precision's range once the adapter's scaling is folded in, as the serving
kernel holds them (``inference.engine.gemv``). The base model's shapes come from the
``config.json`` in its weights folder. A composed adapter is checked here too, so a combination
whose weights overflow is refused like an upload.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np
from safetensors import safe_open

from core.adapter_store import CONFIG_FILE, WEIGHTS_FILE
from core.api_errors import invalid_adapter, shown
from core.catalog import BaseModel

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
DTYPES = ("F16", "BF16", "F32")
# The largest value of half precision, in which the serving kernel holds adapter weights (after
# vLLM folds the scaling lora_alpha / r into B): past it a weight becomes infinite.
HALF_MAX = 65504.0
MAX_CONFIG_BYTES = 64 * 1024  # PEFT writes about one KiB
MAX_CONFIG_DEPTH = 8  # PEFT's configs nest a dict or a list in a field, three levels at most
MAX_WEIGHTS_HEADER_BYTES = 1 << 20  # ~100 bytes a tensor: ten thousand tensors (safetensors itself allows 100 MB)
_VALUES_AT_ONCE = 1 << 18  # values of a tensor checked at a time: 1 MiB of float32
_READ_AS = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}  # bfloat16 as its upper 16 bits of a float32
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
    "lora_bias": "LoRA bias terms (lora_bias)",
    "alora_invocation_tokens": "Activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
}
_BOOLEANS = ("use_rslora", "use_dora", "fan_in_fan_out", "inference_mode", "lora_bias", "use_qalora")
# init_lora_weights values whose saved adapter is a plain LoRA (as vLLM's PEFT helper lists them);
# the others (PiSSA, OLoRA, LoftQ, CorDA) change the base model's weights when PEFT loads it.
_PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")


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
    )


@dataclass(frozen=True)
class CheckedAdapter:
    rank: int
    target_modules: tuple[str, ...]


def check_adapter(folder: Path, base: BaseModel) -> CheckedAdapter:
    """Refuse (``invalid_adapter``, naming the problem) anything but a LoRA that fits ``base``."""
    config = _config(folder / CONFIG_FILE)
    rank = _rank(config, base)
    scaling = _scaling(config, rank)
    _check_fields(config)
    targets = _target_modules(config)
    _check_tensors(folder / WEIGHTS_FILE, architecture(base.weights), base.id, rank, targets)
    formula = "lora_alpha / sqrt(r)" if config.get("use_rslora") else "lora_alpha / r"
    check_weight_values(folder / WEIGHTS_FILE, scaling, formula)
    return CheckedAdapter(rank, targets)


@dataclass(frozen=True)
class LoraShape:
    """What training on from an adapter keeps of it: the adapter it trains has this shape."""

    rank: int
    alpha: int | float
    target_modules: tuple[str, ...]


def lora_shape(config: dict[str, Any], base: BaseModel) -> LoraShape:
    """The rank, alpha and target modules of a published ``adapter_config.json``, checked as an
    upload's are (``invalid_adapter`` naming the problem): a continued fine-tune of an adapter that
    no job here trained reads its shape from there."""
    _check_values(config)
    rank = _rank(config, base)
    _scaling(config, rank)  # lora_alpha a number within what is served
    return LoraShape(rank, config["lora_alpha"], _target_modules(config))


def check_weight_values(path: Path, scaling: float, scaling_is: str = "lora_alpha / r") -> None:
    """Refuse a weights file with a value that is not finite, or past ``HALF_MAX`` as the serving
    kernel holds it: A as it is, B times the adapter's ``scaling`` (``scaling_is`` says how that
    was computed). Reads a slice of a tensor at a time, so memory stays small whatever its size."""
    for name, values in _tensor_slices(path):
        factor = scaling if name.endswith("lora_B.weight") else 1.0
        if not np.isfinite(values).all():
            raise invalid_adapter(f"the tensor {name} holds NaN or infinite values; every weight must be finite")
        largest = float(np.abs(values).max(initial=0.0))
        if largest * abs(factor) > HALF_MAX:
            scaled = ""
            if factor != 1.0:
                scaled = f", which times its scaling ({scaling_is} = {factor:g}) is {largest * abs(factor):g}"
            raise invalid_adapter(
                f"the tensor {name} holds a value of {largest:g}{scaled}, past {HALF_MAX:g}, the largest value of "
                "half precision, in which the inference engine holds adapter weights"
            )


def served_config(folder: Path, base_model_id: str) -> None:
    """Name the base model as the platform serves it, so vLLM's check and PEFT both accept it."""
    path = folder / CONFIG_FILE
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = base_model_id
    path.write_text(json.dumps(config, indent=2))


class _Constant(str):
    """NaN, Infinity or -Infinity where JSON has a number (Python's json reads them; JSON has none)."""


def _config(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise invalid_adapter(
            f"{CONFIG_FILE} is {size} bytes; a LoRA config takes about one KiB (at most {MAX_CONFIG_BYTES} accepted)"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"), parse_constant=_Constant)
    except RecursionError:
        raise invalid_adapter(f"{CONFIG_FILE} is nested too deeply to read; a LoRA config is a flat object") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid_adapter(f"{CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise invalid_adapter(f"{CONFIG_FILE} must hold a JSON object")
    _check_values(config)
    if config.get("peft_type") != "LORA":
        raise invalid_adapter(
            f'peft_type is {_shown(config.get("peft_type"))}; only LoRA adapters ("LORA") are accepted'
        )
    for key in _BOOLEANS:
        if config.get(key) is not None and not isinstance(config[key], bool):
            raise invalid_adapter(f"{key} must be true or false, not {_shown(config[key])}")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise invalid_adapter(f"the adapter uses {what}, which the inference engine cannot serve")
    return config


def _check_values(config: dict[str, Any]) -> None:
    """Every number finite (NaN, Infinity, or a float past 1.8e308 read as infinite), nothing nested
    deeper than ``MAX_CONFIG_DEPTH``; each refusal names the field. Iterative: no recursion to exhaust."""
    stack: list[tuple[str, Any, int]] = [(key, value, 1) for key, value in config.items()]
    while stack:
        where, value, depth = stack.pop()
        if depth > MAX_CONFIG_DEPTH:
            raise invalid_adapter(
                f"{CONFIG_FILE} is nested too deeply (at {_cut(where)}); a LoRA config is a flat object"
            )
        if isinstance(value, _Constant) or (isinstance(value, float) and not math.isfinite(value)):
            raise invalid_adapter(f"{_cut(where)} is {value}; the numbers in {CONFIG_FILE} must be finite")
        if isinstance(value, dict):
            stack.extend((f"{where}.{key}", item, depth + 1) for key, item in value.items())
        elif isinstance(value, list):
            stack.extend((f"{where}[{index}]", item, depth + 1) for index, item in enumerate(value))


def _shown(value: Any) -> str:
    """A config value for a message, cut short: a field can hold a long string."""
    return _cut(repr(value))


def _cut(text: str) -> str:
    return shown(text, most=80)


def _rank(config: dict[str, Any], base: BaseModel) -> int:
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise invalid_adapter(f"r (the LoRA rank) must be a positive whole number, not {_shown(rank)}")
    if rank > base.lora.max_lora_rank:
        raise invalid_adapter(
            f"its rank r={rank} is larger than {base.id}'s max_lora_rank of {base.lora.max_lora_rank}"
        )
    return rank


def _scaling(config: dict[str, Any], rank: int) -> float:
    """The adapter's scaling, ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA), as PEFT and vLLM compute it.
    vLLM requires lora_alpha (PEFT always writes it)."""
    alpha = config.get("lora_alpha")
    if not _is_number(alpha):
        raise invalid_adapter(f"lora_alpha (the numerator of the LoRA scaling) must be a number, not {_shown(alpha)}")
    if not 0 < alpha <= HALF_MAX:
        raise invalid_adapter(
            f"lora_alpha is {_shown(alpha)}; it must be more than 0 and at most {HALF_MAX:g} (the scaling "
            "lora_alpha / r multiplies weights the inference engine holds in half precision)"
        )
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # JSON's true is not 1


def _check_fields(config: dict[str, Any]) -> None:
    """The other fields PEFT's LoraConfig gives a type to that matter here."""
    dropout = config.get("lora_dropout")
    if dropout is not None and not (_is_number(dropout) and 0 <= dropout <= 1):
        raise invalid_adapter(f"lora_dropout must be a number from 0 to 1, not {_shown(dropout)}")
    layers = config.get("layers_to_transform")
    listed = layers if isinstance(layers, list) else [layers] if layers is not None else []
    if any(isinstance(layer, bool) or not isinstance(layer, int) or layer < 0 for layer in listed):
        raise invalid_adapter(f"layers_to_transform must be a layer number or a list of them, not {_shown(layers)}")
    init = config.get("init_lora_weights", True)
    if not isinstance(init, (bool, str)):
        raise invalid_adapter(f"init_lora_weights must be true, false or an initialisation's name, not {_shown(init)}")
    if isinstance(init, str) and init.lower() not in _PLAIN_INITS:
        raise invalid_adapter(
            f"init_lora_weights is {_shown(init)}, which changes the base model's weights when the adapter is "
            "loaded; the inference engine cannot serve it (convert it to a plain LoRA with PEFT first)"
        )


def _target_modules(config: dict[str, Any]) -> tuple[str, ...]:
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise invalid_adapter(f"target_modules must be a list of module names, not {targets!r}")
    unknown = sorted(set(targets) - set(ATTENTION + MLP))
    if unknown:
        raise invalid_adapter(
            f"target_modules {unknown} are not linear layers of the base model; choose from {list(ATTENTION + MLP)}"
        )
    return tuple(targets)


def _check_tensors(path: Path, arch: Architecture, base_id: str, rank: int, targets: tuple[str, ...]) -> None:
    _header(path)  # bounded before safe_open reads it
    try:
        with safe_open(str(path), framework="numpy") as weights:
            shapes = {
                name: (weights.get_slice(name).get_shape(), weights.get_slice(name).get_dtype())
                for name in weights.keys()
            }
    except Exception:  # safetensors raises its own error types for a bad header; their words name internals
        raise invalid_adapter(
            f"{WEIGHTS_FILE} is not a readable safetensors file (its header does not fit its data)"
        ) from None
    if not shapes:
        raise invalid_adapter(f"{WEIGHTS_FILE} holds no tensors")
    pairs: dict[tuple[int, str], set[str]] = {}
    for name, (shape, dtype) in sorted(shapes.items()):
        match = _TENSOR.fullmatch(name)
        if match is None:
            raise invalid_adapter(f"the tensor {name} is not a LoRA weight of a decoder layer's linear module")
        layer, block, module, half = int(match[1]), match[2], match[3], match[4]
        if module not in (ATTENTION if block == "self_attn" else MLP) or module not in targets:
            raise invalid_adapter(
                f"the tensor {name} is for {block}.{module}, not one of target_modules {list(targets)}"
            )
        if layer >= arch.layers:
            raise invalid_adapter(
                f"the tensor {name} is for layer {layer}; {base_id} has {arch.layers} layers (0 to {arch.layers - 1})"
            )
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


def _header(path: Path) -> tuple[int, dict[str, Any]]:
    """(where the tensors' data starts, the safetensors header), its size bounded before it is read."""
    unreadable = f"{WEIGHTS_FILE} is not a readable safetensors file"
    with path.open("rb") as file:
        prefix = file.read(8)
        size = int.from_bytes(prefix, "little")
        if len(prefix) < 8 or size < 2:
            raise invalid_adapter(unreadable)
        if size > MAX_WEIGHTS_HEADER_BYTES:
            raise invalid_adapter(
                f"{WEIGHTS_FILE}'s header takes {size} bytes; an adapter's takes a few KiB "
                f"(at most {MAX_WEIGHTS_HEADER_BYTES} accepted)"
            )
        try:
            header = json.loads(file.read(size))
        except (ValueError, RecursionError):
            raise invalid_adapter(f"{unreadable} (its header is not valid JSON)") from None
    if not isinstance(header, dict):
        raise invalid_adapter(unreadable)
    return 8 + size, header


def _tensor_slices(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Each tensor's values as float32, ``_VALUES_AT_ONCE`` at a time (``safe_open`` checked the
    header against the file already; safetensors' NumPy reader has no bfloat16)."""
    start, header = _header(path)
    with path.open("rb") as file:
        for name, info in sorted(header.items()):
            if name == "__metadata__":
                continue
            read_as = np.dtype(_READ_AS[info["dtype"]])
            begin, end = info["data_offsets"]
            file.seek(start + begin)
            left = (end - begin) // read_as.itemsize
            while left > 0:
                count = min(left, _VALUES_AT_ONCE)
                values = np.frombuffer(file.read(count * read_as.itemsize), dtype=read_as)
                left -= count
                if info["dtype"] == "BF16":
                    yield name, (values.astype(np.uint32) << 16).view(np.float32)
                else:
                    yield name, values.astype(np.float32)
