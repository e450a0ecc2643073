"""The base model with a fresh LoRA adapter on it, and how an adapter is written to disk."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from workers.training.attention import PACKED_SDPA
from workers.training.config import TrainingConfig

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
TRAINED = "default"  # PEFT's name for the adapter being trained
REFERENCE = "reference"  # DPO's frozen reference adapter, when there is one (TrainingConfig.reference_adapter)


def load_model_with_lora(config: TrainingConfig) -> PeftModel:
    """The frozen base model in float32 (``load_base_model``) with a trainable LoRA adapter: a fresh
    one, or the parent adapter ``config.init_adapter`` of a continued fine-tune.

    Call after seeding: the adapter's initial A matrices are random.
    """
    base = load_base_model(config.base_model_path)
    if config.init_adapter is None:
        model = get_peft_model(base, lora_config(config))
    else:
        adapter = LoraConfig.from_pretrained(config.init_adapter)
        adapter.lora_dropout = config.lora_dropout  # a training choice of this run, not part of the weights
        model = PeftModel.from_pretrained(base, config.init_adapter, is_trainable=True, config=adapter)
    if config.reference_adapter is not None:
        # A few MB of LoRA matrices beside the trained ones, frozen: the base model is held once.
        model.load_adapter(config.reference_adapter, adapter_name=REFERENCE, is_trainable=False)
        model.set_adapter(TRAINED)
    # PEFT would record the local folder; readers of the adapter (vLLM's resolver) match the public id.
    model.peft_config[TRAINED].base_model_name_or_path = config.base_model_id
    return model


def load_base_model(base_model_path: Path | str) -> torch.nn.Module:
    """The base model in float32, with the packed attention (attention.py), ready to take an adapter.

    The weights ship in bf16, but CPUs without native bf16 matrix instructions (AVX512-BF16, AMX) emulate
    it: measured on such a CPU, a step under bf16 autocast ran 15-20 times slower than in float32. So the
    weights are upcast once at load time.
    """
    base = AutoModelForCausalLM.from_pretrained(base_model_path, dtype=torch.float32, attn_implementation=PACKED_SDPA)
    base.config.use_cache = False  # training never decodes; a cache would only cost memory
    return base


@contextmanager
def reference_model(model: PeftModel) -> Iterator[None]:
    """Within it, ``model`` computes as DPO's reference: the loaded reference adapter in place of the
    trained one, or without it the base model alone (PEFT's ``disable_adapter``). No second copy of the
    model is made. Use it under ``torch.no_grad()``: the reference is never trained."""
    if REFERENCE not in model.peft_config:
        with model.disable_adapter():
            yield
        return
    model.set_adapter(REFERENCE, inference_mode=True)
    try:
        yield
    finally:
        model.set_adapter(TRAINED)  # trainable again (PEFT's set_adapter sets requires_grad)


def save_adapter(model: PeftModel, adapter_dir: Path) -> Path:
    """Write the adapter to ``adapter_dir`` atomically: a reader sees no folder or a complete one.

    Only the LoRA matrices are saved (no embeddings or lm_head: the base model provides those), in
    PEFT's standard layout, which PEFT and vLLM's LoRA loader both read.
    """
    adapter_dir = Path(adapter_dir)
    staging = adapter_dir.with_name(f".{adapter_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True, save_embedding_layers=False, selected_adapters=[TRAINED])
    # PEFT also writes a model card naming the local base-model folder: not ours to publish.
    (staging / "README.md").unlink(missing_ok=True)
    missing = [name for name in ADAPTER_FILES if not (staging / name).is_file()]
    if missing:
        raise RuntimeError(f"PEFT did not write {missing} to the adapter folder")
    shutil.rmtree(adapter_dir, ignore_errors=True)  # a retried job overwrites its own earlier output
    staging.rename(adapter_dir)
    return adapter_dir


def lora_config(config: TrainingConfig) -> LoraConfig:
    """The adapter a job trains (also what the benchmarks give PEFT in the other trainers)."""
    return build_lora_config(
        config.lora_r, config.lora_alpha, config.lora_dropout, config.target_modules or "all-linear"
    )


def build_lora_config(r: int, alpha: int, dropout: float, target_modules: list[str] | str) -> LoraConfig:
    """A causal-LM LoRA of rank ``r`` on ``target_modules`` (module names, or PEFT's "all-linear"), no biases."""
    return LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, bias="none", task_type="CAUSAL_LM"
    )
