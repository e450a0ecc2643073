"""Add a base model to the catalog from a Hugging Face folder or a GGUF file (``manage.py add_base_model``).

Everything is checked before anything is written (``finetuning.base_models.folder_check``); then the weights are
copied (or linked) to DATA_DIR/models/<id>, and the catalog gets one more entry, written atomically with
its comments kept. The new entry takes its serving settings (adapters, engine, autoscaling) from the
catalog's first model, the shipped one, whose numbers were measured on the machines this runs on; the
dtype is the one this machine computes well, and the context no longer than the model's own.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from core.catalog import BaseModel, Catalog, ToolCalling, catalog_entry, load_catalog
from core.chat_tokens import CHAT_TEMPLATE_FILE
from core.catalog_file import replace_catalog, with_model_appended
from core.compute_dtype import ComputeDtype, asked, compute_dtype
from core.memory_plan import ReplicaMemory, replica_memory
from core.model_names import is_valid_base_model_id
from finetuning.base_models.folder_check import CheckedFolder, ModelFolderRefused, check_model_folder

MODELS_FOLDER = "models"  # under DATA_DIR, as the shipped entry's weights are
GGUF_SUFFIX = ".gguf"


@dataclass(frozen=True)
class NewBaseModel:
    source: Path  # a Hugging Face model folder, or a .gguf file (converted as set-up converts the shipped one)
    model_id: str | None = None  # None: the folder's name (a GGUF file's name without .gguf)
    chat_template: Path | None = None  # a Jinja chat template, for a folder that has none (or to replace its own)
    link: bool = False  # link to the folder's files instead of copying them
    dtype: str | None = None  # one of compute_dtype.DTYPES; None: the one this machine computes well
    tool_call_parser: str | None = None  # vLLM's parser of the template's tool calls; None: detected


@dataclass(frozen=True)
class CatalogPlace:
    """Where the catalog and the weights are: the configuration's MODEL_CATALOG, DATA_DIR and DYNAMIC_LORA_PATH."""

    catalog: Path
    data_dir: Path
    default_lora_path: str

    def load(self, path: Path | None = None) -> Catalog:
        return load_catalog(path or self.catalog, self.data_dir, self.default_lora_path)


@dataclass(frozen=True)
class AddedBaseModel:
    model: BaseModel
    memory: ReplicaMemory
    dtype: ComputeDtype


def add_base_model(request: NewBaseModel, place: CatalogPlace) -> AddedBaseModel:
    """Check ``request`` and add it; ``ModelFolderRefused`` (or ``ConfigError`` for the catalog itself)
    names what is wrong, and then nothing has been written."""
    source = request.source
    is_gguf = source.suffix == GGUF_SUFFIX and source.is_file()
    model_id = request.model_id or (source.stem if is_gguf else source.resolve().name)
    if not is_valid_base_model_id(model_id):
        raise ModelFolderRefused(
            f"model id {model_id!r} is not allowed: 'name' or 'owner/name', each part letters, digits, '.', '_' "
            "or '-', starting with a letter or digit, at most 96 characters"
        )
    catalog = place.load()
    if model_id in catalog.ids:
        raise ModelFolderRefused(
            f"model id {model_id!r} is already in the catalog {place.catalog}: choose another --id"
        )
    target = place.data_dir / MODELS_FOLDER / model_id
    if target.exists() or target.is_symlink():
        raise ModelFolderRefused(f"{target} already exists: remove it or choose another --id")
    if is_gguf and request.link:
        raise ModelFolderRefused("a GGUF file is converted, so its weights cannot be linked: leave out --link")
    template = _read_template(request.chat_template)

    with _model_folder(source, is_gguf, target) as folder:
        checked = check_model_folder(folder, template, request.tool_call_parser)
        dtype = compute_dtype() if request.dtype is None else asked(request.dtype)
        model = _new_entry(catalog.models[0], model_id, target, checked, dtype)
        text = with_model_appended(
            place.catalog.read_text(), catalog_entry(model, place.data_dir, place.default_lora_path)
        )
        try:
            replace_catalog(
                place.catalog, text, check=place.load,
                before_swap=lambda: _place_weights(checked, target, link=request.link, move=is_gguf),
            )
        except BaseException:
            _remove(target)  # weights placed for an entry that was not written would be orphans
            raise
    return AddedBaseModel(model, replica_memory(model), dtype)


def _read_template(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelFolderRefused(f"--chat-template {path} cannot be read: {exc}") from exc


@contextmanager
def _model_folder(source: Path, is_gguf: bool, target: Path) -> Iterator[Path]:
    """The Hugging Face folder to check: ``source`` itself, or a GGUF converted beside ``target`` (removed
    unless the weights were moved from it into place)."""
    if not is_gguf:
        yield source
        return
    from core.prepare_weights import convert_gguf

    staging = _staging(target, "gguf")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        try:
            convert_gguf(source, staging)
        except Exception as exc:  # transformers refuses a GGUF architecture or quantization it cannot read
            raise ModelFolderRefused(f"{source} cannot be converted to a Hugging Face folder: {exc}") from exc
        yield staging
    finally:
        _remove(staging)


def _new_entry(
    template: BaseModel, model_id: str, weights: Path, checked: CheckedFolder, dtype: ComputeDtype
) -> BaseModel:
    engine = dataclasses.replace(
        template.engine,
        dtype=dtype.dtype,
        max_model_len=min(template.engine.max_model_len, checked.context_length),
        extra_args=(),  # the shipped model's own engine flags are not this model's
    )
    tools = ToolCalling(checked.tool_call_parser) if checked.tool_call_parser else None  # its own template's form
    return dataclasses.replace(template, id=model_id, weights=weights, prepare_from=None, engine=engine, tools=tools)


def _place_weights(checked: CheckedFolder, target: Path, link: bool, move: bool) -> None:
    """The checked folder's files at ``target``: moved (a converted GGUF), linked, or copied; whole or not at all."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = _staging(target, "place")
    try:
        if move:
            checked.folder.rename(staging)
        elif link:
            staging.mkdir()
            for entry in checked.folder.resolve().iterdir():
                (staging / entry.name).symlink_to(entry)
        else:
            shutil.copytree(checked.folder, staging, symlinks=False)
        if checked.chat_template is not None:
            written = staging / CHAT_TEMPLATE_FILE
            written.unlink(missing_ok=True)  # a link to the source's own template: replace the link, not the file
            written.write_text(checked.chat_template)
        staging.rename(target)
    finally:
        _remove(staging)


def _staging(target: Path, purpose: str) -> Path:
    return target.with_name(f".{target.name}.{purpose}-{os.getpid()}")


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
