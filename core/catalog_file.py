"""Changes to the catalog file itself (models.toml), which people edit by hand: its comments and
layout survive (tomlkit keeps them), and a change is written whole or not at all."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomlkit


def with_model_appended(text: str, entry: dict[str, Any]) -> str:
    """``text`` with one more ``[[models]]`` entry at its end; everything before it unchanged."""
    # A blank line between the last entry and the new one, as between hand-written entries.
    document = tomlkit.parse(text if text.endswith("\n\n") or not text else text.rstrip("\n") + "\n\n")
    if "models" not in document:
        document["models"] = tomlkit.aot()
    document["models"].append(entry)  # load_catalog has checked it is a list of tables
    return tomlkit.dumps(document)


def replace_catalog(path: Path, text: str, check: Callable[[Path], object], before_swap: Callable[[], object]) -> None:
    """Write ``text`` over the catalog at ``path`` atomically, once ``check`` has read it without error
    from a file beside it and ``before_swap`` has run (what the new entry needs in place first). A reader
    (the pool, the web process) sees the old file or the new one, never half of one; on any error the
    old file stays, byte for byte."""
    staging = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        staging.write_text(text)
        shutil.copymode(path, staging)
        check(staging)
        before_swap()
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)
