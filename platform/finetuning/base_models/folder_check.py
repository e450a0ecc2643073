"""Can the platform serve and fine-tune the base model in a Hugging Face folder? Checked before anything is
written, each refusal naming what is missing or wrong.

- files: ``config.json``, safetensors weights (a ``.bin``-only checkpoint can run pickled code when
  loaded), a tokenizer, and a chat template (the folder's, or one supplied);
- architecture: one the pinned vLLM serves as a text generator with LoRA, and whose decoder layers have
  every module the platform adapts, where the adapter check and the serving kernel look for them
  (``model.layers.<i>.self_attn.{q,k,v,o}_proj`` and ``...mlp.{gate,up,down}_proj``: ``core.adapter_check``),
  and exactly those: PEFT's "all-linear", the trainer's default, must pick nothing else, or a job would
  train an adapter that cannot be served. Found on a model built on the ``meta`` device from config.json,
  so no weight is read;
- chat template: it renders a system/user/assistant exchange and the assistant's reply can be marked for
  training (``core.chat_tokens``, as the trainer marks it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.adapter_check import ATTENTION, MLP
from core.chat_tokens import CHAT_TEMPLATE_FILE, load_tokenizer, tokenize_example
from core.datasets import ExampleError
from finetuning.base_models import tool_call_form

if TYPE_CHECKING:  # importing transformers costs seconds: only the type checker reads it here
    from transformers import PreTrainedTokenizerBase

CONFIG_FILE = "config.json"
# Any one of these is a tokenizer transformers can load: fast (tokenizer.json), SentencePiece, or BPE files.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt")
# The trainer's target modules when a job names none (workers/training/model.py, lora_config).
TRAINER_TARGETS = "all-linear"
PLATFORM_TARGETS = ATTENTION + MLP
_BLOCK = {**{module: "self_attn" for module in ATTENTION}, **{module: "mlp" for module in MLP}}
_PROBE = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four."},
]


class ModelFolderRefused(ValueError):
    """The folder cannot be a base model here; the message says what is missing or wrong and how to fix it."""


@dataclass(frozen=True)
class CheckedFolder:
    folder: Path
    architecture: str
    context_length: int  # the model's max_position_embeddings: the most a replica's max_model_len may be
    chat_template: str | None  # supplied with --chat-template: to be saved with the weights
    tool_call_parser: str | None  # vLLM's parser of the calls the template writes; None: it renders no tools


def check_model_folder(
    folder: Path, chat_template: str | None = None, tool_call_parser: str | None = None
) -> CheckedFolder:
    """``tool_call_parser``: the parser asked for (refused unless it reads the template's calls); None: detected."""
    config = _check_files(folder, supplied_template=chat_template is not None)
    architecture = _check_architecture(config)
    _check_attention(config)
    _check_target_modules(folder, architecture)
    tokenizer = _check_chat_template(folder, config, chat_template)
    try:
        parser = tool_call_form.tool_call_parser(tokenizer, tool_call_parser)
    except tool_call_form.ToolFormRefused as exc:
        raise ModelFolderRefused(str(exc)) from exc
    return CheckedFolder(folder, architecture, _context_length(config), chat_template, parser)


def _check_files(folder: Path, supplied_template: bool) -> dict[str, Any]:
    if not folder.is_dir():
        raise ModelFolderRefused(f"{folder} is not a folder (give a Hugging Face model folder or a .gguf file)")
    problems = []
    config: dict[str, Any] = {}
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        problems.append(f"no {CONFIG_FILE} (the model's Hugging Face configuration)")
    else:
        try:
            config = json.loads(config_path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            problems.append(f"{CONFIG_FILE} is not JSON: {exc}")
        if not isinstance(config, dict):
            problems.append(f"{CONFIG_FILE} is not a JSON object")
            config = {}
    if not any(folder.glob("*.safetensors")):
        pickled = sorted(path.name for pattern in PICKLED_WEIGHTS for path in folder.glob(pattern))
        if pickled:
            problems.append(
                f"weights only as pickled files ({', '.join(pickled)}), which can run code when loaded: convert them "
                "to safetensors (transformers: from_pretrained(folder).save_pretrained(new_folder) writes safetensors)"
            )
        else:
            problems.append("no weights (*.safetensors)")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        problems.append(f"no tokenizer (one of {', '.join(TOKENIZER_FILES)})")
    if not supplied_template and not _has_chat_template(folder):
        problems.append(
            f"no chat template (neither {CHAT_TEMPLATE_FILE} nor a chat_template in tokenizer_config.json): "
            "supply one with --chat-template FILE"
        )
    if problems:
        raise ModelFolderRefused(f"{folder} cannot be a base model: " + "; ".join(problems))
    return config


def _has_chat_template(folder: Path) -> bool:
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        return True
    tokenizer_config = folder / "tokenizer_config.json"
    try:
        return bool(tokenizer_config.is_file() and json.loads(tokenizer_config.read_text()).get("chat_template"))
    except (ValueError, AttributeError):
        return False


def _check_architecture(config: dict[str, Any]) -> str:
    architectures = config.get("architectures")
    if not (isinstance(architectures, list) and len(architectures) == 1 and isinstance(architectures[0], str)):
        raise ModelFolderRefused(f"{CONFIG_FILE} must name one architecture in 'architectures', not {architectures!r}")
    architecture = architectures[0]
    served = _served_by_vllm(architecture)
    if served is not None:
        raise ModelFolderRefused(f"architecture {architecture}: {served}")
    import transformers

    if not hasattr(transformers, architecture):
        raise ModelFolderRefused(
            f"architecture {architecture}: the installed transformers has no such class, so the trainer (PEFT on "
            "transformers) cannot adapt it"
        )
    return architecture


def _check_attention(config: dict[str, Any]) -> None:
    """vLLM loads a model whose attention heads its platform's attention kernel cannot compute, and
    its engine dies on the first request (on the CPU: "Unsupported CPU attention configuration")."""
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (
        config.get("hidden_size", 0) // heads if isinstance(heads, int) and heads > 0 else None
    )
    supported = _attention_head_sizes()
    if supported is not None and head_dim not in supported:
        raise ModelFolderRefused(
            f"attention heads of {head_dim} dimensions (head_dim, or hidden_size / num_attention_heads): vLLM's "
            f"attention on this machine computes heads of {', '.join(map(str, supported))} only"
        )


def _attention_head_sizes() -> list[int] | None:
    """The head sizes the pinned vLLM's attention computes on this platform; None: not known here (on a
    GPU vLLM picks among several backends, and the check is left to it)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())


def _served_by_vllm(architecture: str) -> str | None:
    """Why the pinned vLLM cannot serve ``architecture`` with LoRA adapters; None when it can."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora
    from vllm.model_executor.models.interfaces_base import is_text_generation_model

    if architecture not in ModelRegistry.get_supported_archs():
        return "not one the installed vLLM serves (vllm.model_executor.models.ModelRegistry.get_supported_archs())"
    # Importing the class is not starting an engine, but the registry's public way to it needs a whole
    # ModelConfig (which reads the weights' metadata and the platform): its private loader is asked, where
    # it is what the pinned vLLM has; another vLLM gets a refusal that says so, not a traceback.
    load = getattr(ModelRegistry, "_try_load_model_cls", None)
    if not callable(load):
        return "cannot be checked: this vLLM's ModelRegistry has no _try_load_model_cls (pinned: constraints.txt)"
    model_class = load(architecture)
    if model_class is None:
        return "vLLM lists it but cannot import its implementation"
    if not is_text_generation_model(model_class):
        return "vLLM serves it, but not as a text generator (chat completions)"
    if not supports_lora(model_class):
        return "vLLM serves it, but without LoRA adapters (its class does not implement SupportsLoRA)"
    return None


def _check_target_modules(folder: Path, architecture: str) -> None:
    import torch
    from accelerate import init_empty_weights
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights():  # parameters on the meta device: shapes only, no memory, no weights read
        model = AutoModelForCausalLM.from_config(config)
        expected = _platform_modules(config.num_hidden_layers)
        linear = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
        missing = sorted(expected - linear)
        if missing:
            shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
            raise ModelFolderRefused(
                f"architecture {architecture} lacks LoRA target modules the platform adapts "
                f"({', '.join(PLATFORM_TARGETS)} in every decoder layer): no linear layer {shown}"
            )
        peft_model = get_peft_model(model, LoraConfig(r=1, target_modules=TRAINER_TARGETS, task_type="CAUSAL_LM"))
    adapted = {name.removeprefix("base_model.model.") for name in peft_model.targeted_module_names}
    if adapted != expected:
        extra = sorted(adapted - expected)[:6]
        raise ModelFolderRefused(
            f"architecture {architecture}: PEFT's {TRAINER_TARGETS!r} (the trainer's default) adapts modules the "
            f"platform cannot serve an adapter of, e.g. {', '.join(extra) or sorted(expected - adapted)[:6]}"
        )


def _platform_modules(layers: int) -> set[str]:
    return {f"model.layers.{i}.{_BLOCK[module]}.{module}" for i in range(layers) for module in PLATFORM_TARGETS}


def _check_chat_template(folder: Path, config: dict[str, Any], chat_template: str | None) -> PreTrainedTokenizerBase:
    try:
        tokenizer = load_tokenizer(folder)
    except Exception as exc:  # transformers raises many kinds; any of them means no usable tokenizer
        raise ModelFolderRefused(f"the tokenizer in {folder} does not load: {exc}") from exc
    vocab_size = config.get("vocab_size")
    if isinstance(vocab_size, int) and len(tokenizer) > vocab_size:
        raise ModelFolderRefused(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab_size}: "
            "they are not made for each other"
        )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    try:
        tokens = tokenize_example(tokenizer, _PROBE)
    except ExampleError as exc:
        raise ModelFolderRefused(f"the chat template cannot be trained on: {exc}") from exc
    except Exception as exc:  # a template that does not parse or render: jinja2 and transformers errors alike
        raise ModelFolderRefused(f"the chat template does not render a system/user/assistant exchange: {exc}") from exc
    trained = tokenizer.decode([token for token, is_trained in zip(tokens.input_ids, tokens.trained) if is_trained])
    if _PROBE[-1]["content"] not in trained:
        raise ModelFolderRefused(
            "the chat template renders the exchange, but the assistant's reply cannot be told apart from the "
            f"rest (the tokens marked for training read {trained!r})"
        )
    return tokenizer


def _context_length(config: dict[str, Any]) -> int:
    length = config.get("max_position_embeddings")
    if not isinstance(length, int) or length < 1:
        raise ModelFolderRefused(f"{CONFIG_FILE} has no max_position_embeddings (the model's context length)")
    return length
