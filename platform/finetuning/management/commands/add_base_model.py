"""Add a base model to the catalog (models.toml) from a Hugging Face folder or a GGUF file.

Only translates: the arguments to ``finetuning.base_models.intake.add_base_model``, its refusal to a
``CommandError`` (exit status 1, the catalog unchanged), its result to a few lines. The processes that
serve and train read the catalog when they start: restart them to offer the new model.
"""

from __future__ import annotations

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser

from core.compute_dtype import DTYPES
from core.config import load_config
from core.env import ConfigError
from finetuning.base_models.folder_check import ModelFolderRefused
from finetuning.base_models.intake import CatalogPlace, NewBaseModel, add_base_model


class Command(BaseCommand):
    help = (
        "Add a base model from FOLDER (a Hugging Face model folder: config.json, safetensors weights, a "
        "tokenizer and a chat template) or from a .gguf file, after checking it can be served and fine-tuned here."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("folder", type=Path, help="a Hugging Face model folder, or a .gguf file")
        parser.add_argument(
            "--id", dest="model_id", help="the model's id, e.g. 'Qwen/Qwen2-0.5B-Instruct' (default: the folder's name)"
        )
        parser.add_argument("--chat-template", type=Path, help="a Jinja chat template file, for a model that has none")
        parser.add_argument(
            "--tool-call-parser",
            help="vLLM's tool-call parser for the calls the chat template writes, e.g. hermes (default: detected; "
            "refused unless it reads them)",
        )
        parser.add_argument("--link", action="store_true", help="link to the folder's files instead of copying them")
        parser.add_argument(
            "--dtype", choices=DTYPES,
            help="what the model computes in (default: the one this machine computes well; on a CPU, the "
            "platform's LoRA kernels and mixes computed in them take float32)",
        )

    def handle(self, *args: object, folder: Path, model_id: str | None, chat_template: Path | None, link: bool,
               dtype: str | None, tool_call_parser: str | None, **options: object) -> None:
        config = load_config()
        place = CatalogPlace(config.model_catalog, config.data_dir, config.dynamic_lora_path)
        request = NewBaseModel(folder, model_id, chat_template, link, dtype, tool_call_parser)
        try:
            added = add_base_model(request, place)
        except (ModelFolderRefused, ConfigError) as exc:
            raise CommandError(f"{exc}. Nothing was written.") from exc
        model = added.model
        self.stdout.write(f"Added {model.id} to {place.catalog}: weights at {model.weights}.")
        self.stdout.write(
            f"dtype {model.engine.dtype} ({added.dtype.why}); max_model_len {model.engine.max_model_len}."
        )
        tools = f"tool calls read by vLLM's {model.tools.parser} parser" if model.tools else "no tools (its chat template renders none)"
        self.stdout.write(f"Tools: {tools}.")
        self.stdout.write(f"Memory: {added.memory.describe()}.")
        self.stdout.write("Restart the platform's processes (bin/run) to serve and fine-tune it.")
