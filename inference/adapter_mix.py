"""A mix: fine-tunes of one base model, each with a scale, served in the kernel from its parts'
slots (``inference.engine.mixes``), or where the replica cannot, as one combined adapter.

Its name comes from its content: the parts' names, their published versions and their scales. The
same mix asked again finds its adapter loaded; a republished part makes a new mix (and the old one
is unloaded, as a deleted adapter is, by ``AdapterManager.retire_deleted``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from core import api_errors
from core.model_names import is_valid_suffix, parse_model_name, pinned_name
from core.openai_protocol import RoutedFields, adapter_scales
from inference.adapter_source import AdapterSource
from inference.engine_contract import write_manifest

MIXES_FOLDER = ".mixes"  # in the pool's adapter cache: the combined adapters, one folder per digest
_NAME_MARK = ":mix."  # between the base model's id and the digest in a mix's name (``Mix.name``)


def is_mix_name(name: str) -> bool:
    """Whether an adapter's name is a mix's (no fine-tuned model's suffix holds a '.')."""
    return _NAME_MARK in name


@dataclass(frozen=True)
class MixPart:
    name: str  # a fine-tuned model: its adapter in the dynamic LoRA path
    version: str  # the published version it was combined from
    scale: float
    pinned: str  # that version's name in vLLM (``core.model_names.pinned_name``): a kernel mix's part


@dataclass(frozen=True)
class Mix:
    base_id: str
    parts: tuple[MixPart, ...]  # sorted by name, none of scale 0

    @property
    def digest(self) -> str:
        content = json.dumps([self.base_id] + [[part.name, part.version, part.scale] for part in self.parts])
        return hashlib.sha256(content.encode()).hexdigest()[:24]

    @property
    def part_names(self) -> tuple[str, ...]:
        """The parts' names in vLLM."""
        return tuple(part.pinned for part in self.parts)

    @property
    def name(self) -> str:
        """The combined adapter's name in vLLM. The '.' is a character no suffix may hold
        (``core.model_names``): a mix never shares a name with a fine-tuned model."""
        return f"{self.base_id}{_NAME_MARK}{self.digest}"


def requested_scales(fields: RoutedFields, base_id: str) -> dict[str, float]:
    """The fine-tunes a request's ``adapters`` mixes, each with its scale (none 0), once checked
    that ``model`` is their base model and each is a fine-tune of it."""
    if fields.model != base_id:
        raise api_errors.mix_needs_base_model(fields.model)
    scales = adapter_scales(fields)
    for part in scales:
        name = parse_model_name(part)
        if name.base_model_id != base_id or name.suffix is None or not is_valid_suffix(name.suffix):
            raise api_errors.model_not_found(part, param="adapters")
    return scales


async def published_mix(source: AdapterSource, base_id: str, scales: dict[str, float]) -> Mix:
    """The mix of these adapters (name -> scale, none 0) at the versions ``source`` publishes now."""
    parts = []
    for name, scale in scales.items():
        found = await source.version(name)
        if found is None:
            raise api_errors.adapter_not_found(name, param="adapters")
        parts.append(MixPart(name, found.identity, scale, pinned_name(name, found.version)))
    return Mix(base_id, tuple(parts))


def refuse_past_batch_slots(needs: tuple[str, ...], slots: int) -> None:
    """A kernel mix takes a batch slot per part: one needing more than the batch has would never
    start, so it is refused at once (400 ``mix_too_many_parts``)."""
    if len(needs) > slots:
        raise api_errors.mix_too_many_parts(len(needs), slots)


def mix_folder(cache_dir: Path, mix: Mix, in_kernel: bool = False) -> Path:
    """A built mix's adapter in an adapter cache, or a kernel mix's manifest (apart: replicas of both
    kinds may serve it)."""
    return cache_dir / MIXES_FOLDER / (f"{mix.digest}.parts" if in_kernel else mix.digest)


def manifest_folder(cache_dir: Path, mix: Mix) -> Path:
    """A kernel mix's folder, written: the manifest of its parts (``inference.engine.mixes``)."""
    folder = mix_folder(cache_dir, mix, in_kernel=True)
    write_manifest(folder, [(part.pinned, part.scale) for part in mix.parts])
    return folder
