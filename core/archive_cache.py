"""Archives built once and kept on this host's disk, each under a key that names exactly what it
holds (a published revision of an adapter never changes, so neither does its archive).

Packing an adapter is gzip over its weights: seconds for a large one, which every download paid
before. Here the first download builds the archive (into a temporary name, renamed into place, so a
reader never opens half of one) and the next ones open it. The least recently used archives are
removed once the cache holds more than ``max_bytes``; an archive being sent stays readable after its
removal (the open file outlives its name).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

_SUFFIX = ".tar.gz"
_STALE_BUILD_S = 3600  # a temporary file this old is what a crashed build left


class ArchiveCache:
    def __init__(self, root: Path, max_bytes: int):
        self.root, self.max_bytes = root, max_bytes

    def open(self, key: str, build: Callable[[BinaryIO], None]) -> BinaryIO:
        """The archive kept under ``key``, open for reading; built by ``build`` (which writes it to
        the file it is given) when it is not kept yet. The caller closes it."""
        path = self.root / (hashlib.sha256(key.encode()).hexdigest() + _SUFFIX)
        try:
            archive = path.open("rb")
        except FileNotFoundError:
            return self._built(path, build)
        os.utime(path)  # recently used: removed last
        return archive

    def _built(self, path: Path, build: Callable[[BinaryIO], None]) -> BinaryIO:
        self.root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=self.root, prefix=".building-", delete=False) as out:
            try:
                build(out)  # type: ignore[arg-type]  # a binary file
            except BaseException:
                out.close()
                os.unlink(out.name)
                raise
        os.replace(out.name, path)
        archive = path.open("rb")
        self._evict(keep=path)
        return archive

    def _evict(self, keep: Path) -> None:
        entries = []
        for entry in os.scandir(self.root):
            try:
                stat = entry.stat()
            except FileNotFoundError:
                continue  # removed meanwhile by another process
            if entry.name.startswith(".building-"):
                if time.time() - stat.st_mtime > _STALE_BUILD_S:
                    Path(entry.path).unlink(missing_ok=True)
            elif entry.name.endswith(_SUFFIX):
                entries.append((stat.st_mtime, stat.st_size, Path(entry.path)))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):  # the least recently used first
            if total <= self.max_bytes:
                break
            if path != keep:
                path.unlink(missing_ok=True)
                total -= size
