"""A second base model for the tests, of another architecture than the shipped one: a tiny Qwen2.

Built here, with no model hub: Qwen2ForCausalLM (biases on q/k/v, unlike Llama) with random weights
from a fixed seed, saved as float32 safetensors by transformers, beside the shipped SmolLM2 tokenizer
and its ChatML chat template (the vocabulary sized to that tokenizer). Small enough to build in about
a second and to train a few steps on in a few more.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from core.chat_tokens import load_tokenizer
from tests.environment import ROOT

SHIPPED_MODEL = ROOT / "data" / "models" / "HuggingFaceTB" / "SmolLM2-135M-Instruct"
SEED = 1234


def build_tiny_qwen2(folder: Path) -> Path:
    """Write the tiny Qwen2 model folder at ``folder`` (config.json, model.safetensors, tokenizer, chat template)."""
    tokenizer = load_tokenizer(SHIPPED_MODEL)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,  # four heads of 32: vLLM's CPU attention computes no narrower head (16 dies on a request)
        intermediate_size=256,
        # Four: with fewer than 20 adapted modules (2 layers x 7) PEFT records all-linear's targets as full paths
        # ("model.layers.0.mlp.up_proj"), not the short names a real model's adapter (and core.adapter_check) has.
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, as the real Qwen2 models have
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # the same weights every time, without disturbing the caller's seed
        torch.manual_seed(SEED)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
