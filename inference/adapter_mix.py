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
