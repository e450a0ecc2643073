"""The one place that knows how models are named.

- ``<base_model_id>``: a base model of the catalog.
- ``<base_model_id>:<suffix>``: a fine-tuned model, at its latest revision.
- ``<base_model_id>:<suffix>@r<N>``: one revision of it, which never changes once published.
- ``<base_model_id>:<suffix>:ckpt-step-<N>`` (``<suffix>@r<N>:ckpt-step-<N>`` for a revision after
  the first): a checkpoint its job saved at the end of an epoch, servable while the job trains.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SUFFIX_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
_FINE_TUNED = re.compile(
    r"(?P<suffix>[A-Za-z0-9_-]{1,64})(?:@r(?P<revision>[1-9]\d{0,8}))?(?::ckpt-step-(?P<step>\d{1,9}))?"
)


@dataclass(frozen=True)
class ModelName:
    base_model_id: str
    suffix: str | None  # None for the base model itself
    revision: int | None = None  # pinned to one revision; None: the latest
    checkpoint_step: int | None = None  # a checkpoint of the job that trains (or trained) it

    def __str__(self) -> str:
        if self.suffix is None:
            return self.base_model_id
        name = f"{self.base_model_id}:{self.suffix}"
        if self.revision is not None:
            name += f"@r{self.revision}"
        if self.checkpoint_step is not None:
            name += f":ckpt-step-{self.checkpoint_step}"
        return name

    @property
    def model(self) -> str:
        """The fine-tuned model this name belongs to: ``<base_model_id>:<suffix>``."""
        return str(ModelName(self.base_model_id, self.suffix))


def parse_model_name(name: str) -> ModelName:
    """Split at the first ':' (base ids never hold one; the catalog refuses them). A malformed rest
    is kept whole as the suffix, which ``is_valid_suffix`` then refuses."""
    base, sep, rest = name.partition(":")
    if not sep:
        return ModelName(name, None)
    match = _FINE_TUNED.fullmatch(rest)
    if match is None:
        return ModelName(base, rest)
    revision, step = match["revision"], match["step"]
    return ModelName(base, match["suffix"], int(revision) if revision else None, int(step) if step else None)


def is_valid_suffix(suffix: str) -> bool:
    return SUFFIX_PATTERN.fullmatch(suffix) is not None


# A base model id an operator adds (``manage.py add_base_model``): Hugging Face's shape, ``name`` or
# ``owner/name``, each part starting with a letter or digit. It names the weights folder
# (DATA_DIR/models/<id>) and the adapters' (<path>/<id>:<suffix>/), so no part may be "." or "..", absolute,
# or hold a ':' (the fine-tune separator) or a backslash.
BASE_MODEL_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(?:/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")


def is_valid_base_model_id(model_id: str) -> bool:
    return BASE_MODEL_ID_PATTERN.fullmatch(model_id) is not None


def revision_tag(revision: int) -> str:
    """How a revision is written after the ``@`` of a name, and as the dynamic LoRA path's version."""
    return f"r{revision}"


_ENDS_PINNED = re.compile(r"@r([0-9]+)$")


def with_revision(name: str, revision: int) -> str:
    """``<name>@r<N>``: revision ``revision`` of ``name``, by its own name."""
    return f"{name}@{revision_tag(revision)}"


def revision_in(name: str) -> int | None:
    """N of a name that ends ``@r<N>`` (one revision's own name); None for any other name, a
    later revision's checkpoint (``<name>@r<N>:ckpt-step-<M>``, a name of its own) included."""
    match = _ENDS_PINNED.search(name)
    return int(match[1]) if match else None


def pinned_name(name: str, version: str) -> str:
    """``name`` pinned to the published ``version`` (``r<N>``) that answers for it: the name the
    engine loads it under, so two revisions are two adapters to it (each its own prefix cache).
    A name already pinned, and a checkpoint (never republished), stay as they are."""
    parsed = parse_model_name(name)
    if parsed.revision is not None or parsed.checkpoint_step is not None:
        return name
    return f"{name}@{version}"
