"""A LoRA adapter as one file to download or upload: a PEFT folder (``adapter_config.json`` and
``adapter_model.safetensors`` at its root) packed as ``.tar.gz``; uploads may be ``.zip`` too.

Unpacking trusts nothing in the archive: only regular files with the expected names, at the root
(``./`` is allowed), no absolute paths, no ``..``, no links or devices; a cap on the number of
members and on the bytes written, counted as they are written (a zip's declared sizes can lie), so
an archive bomb stops at the cap. Every refusal is ``invalid_adapter`` naming the problem, and
leaves nothing behind but the (caller's, temporary) folder it was unpacking into.
"""

from __future__ import annotations

import tarfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import IO, BinaryIO

from core.adapter_store import CONFIG_FILE, WEIGHTS_FILE
from core.api_errors import adapter_too_large, invalid_adapter

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
# What PEFT's save_pretrained writes beside the adapter (a model card): accepted, and not kept.
IGNORED_FILES = ("README.md",)
# A weights file that is not safetensors is a pickle, which can run code when it is loaded.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
MAX_MEMBERS = 8  # the two files, a README, a "./" entry: anything near this is not a PEFT folder
_CHUNK = 1 << 20

_Opener = Callable[[], IO[bytes]]  # opens a member for reading, once it has been checked


def pack(folder: Path, out: BinaryIO) -> None:
    """Write the adapter in ``folder`` to ``out`` as a ``.tar.gz`` with the files at its root."""
    with tarfile.open(fileobj=out, mode="w:gz") as archive:
        for name in ADAPTER_FILES:
            archive.add(folder / name, arcname=name, recursive=False)


def unpack(archive: Path, into: Path, max_bytes: int) -> None:
    """Write the adapter files of ``archive`` (``.tar.gz`` or ``.zip``) into the folder ``into``."""
    written = 0
    names: set[str] = set()
    for name, size, stream in _members(archive):
        if name is None:
            continue  # the root folder's own entry
        if name in names:
            raise invalid_adapter(f"the archive holds {name} twice")
        names.add(name)
        if size > max_bytes - written:  # a member skipped is decompressed too: it counts
            raise adapter_too_large(max_bytes)
        if name in IGNORED_FILES:
            written += size
            continue
        with stream() as source, (into / name).open("wb") as target:
            for block in iter(lambda: source.read(_CHUNK), b""):
                written += len(block)
                if written > max_bytes:
                    raise adapter_too_large(max_bytes)
                target.write(block)
    missing = [name for name in ADAPTER_FILES if name not in names]
    if missing:
        raise invalid_adapter(f"the archive has no {' and no '.join(missing)} at its root (a PEFT LoRA folder has both)")


def _members(archive: Path) -> Iterator[tuple[str | None, int, _Opener]]:
    """Each member as (its checked name, or None for the root folder; its size; how to read it)."""
    if zipfile.is_zipfile(archive):
        yield from _zip_members(archive)
        return
    try:
        with tarfile.open(archive, mode="r:*") as tar:
            for count, member in enumerate(tar, start=1):
                _check_count(count)
                name = _checked_name(member.name, is_dir=member.isdir())
                if not (member.isfile() or (member.isdir() and name is None)):
                    kind = "a symbolic link" if member.issym() else "a hard link" if member.islnk() else "not a regular file"
                    raise invalid_adapter(f"the archive member {member.name!r} is {kind}; only regular files are accepted")
                yield name, member.size, _tar_opener(tar, member)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise invalid_adapter(f"the file is not a readable .tar.gz or .zip archive ({exc})") from None


def _zip_members(archive: Path) -> Iterator[tuple[str | None, int, _Opener]]:
    try:
        with zipfile.ZipFile(archive) as zip_file:
            for count, info in enumerate(zip_file.infolist(), start=1):
                _check_count(count)
                name = _checked_name(info.filename, is_dir=info.is_dir())
                if (info.external_attr >> 16) & 0o170000 == 0o120000:  # the Unix mode says "symlink"
                    raise invalid_adapter(f"the archive member {info.filename!r} is a symbolic link; only regular files are accepted")
                if info.is_dir() and name is not None:
                    raise invalid_adapter(f"the archive member {info.filename!r} is a folder; the files must be at the root")
                yield name, info.file_size, _zip_opener(zip_file, info)
    except (zipfile.BadZipFile, OSError) as exc:
        raise invalid_adapter(f"the file is not a readable .tar.gz or .zip archive ({exc})") from None


def _tar_opener(tar: tarfile.TarFile, member: tarfile.TarInfo) -> _Opener:
    def opened() -> IO[bytes]:
        stream = tar.extractfile(member)
        assert stream is not None  # a regular file, checked above
        return stream

    return opened


def _zip_opener(zip_file: zipfile.ZipFile, info: zipfile.ZipInfo) -> _Opener:
    return lambda: zip_file.open(info)


def _check_count(count: int) -> None:
    if count > MAX_MEMBERS:
        raise invalid_adapter(
            f"the archive holds more than {MAX_MEMBERS} members; an adapter is {' and '.join(ADAPTER_FILES)}"
        )


def _checked_name(raw: str, is_dir: bool) -> str | None:
    """The member's file name, when it is one of the adapter's at the root; None for the root itself."""
    path = PurePosixPath(raw.replace("\\", "/"))
    if path.is_absolute() or raw.startswith(("/", "\\")) or (len(raw) > 1 and raw[1] == ":"):
        raise invalid_adapter(f"the archive member {raw!r} has an absolute path; paths must be relative to the archive root")
    parts = [part for part in path.parts if part != "."]
    if ".." in parts:
        raise invalid_adapter(f"the archive member {raw!r} points outside the archive root ('..')")
    if not parts:
        return None
    if is_dir or len(parts) > 1:
        raise invalid_adapter(
            f"the archive member {raw!r} is not at the archive root; pack the folder's files, not the folder "
            "(tar -czf adapter.tar.gz -C <folder> adapter_config.json adapter_model.safetensors)"
        )
    name = parts[0]
    if name.endswith(PICKLE_SUFFIXES):
        raise invalid_adapter(
            f"{name} is a pickle; only safetensors weights are accepted (save with safe_serialization=True, "
            f"as {WEIGHTS_FILE})"
        )
    if name not in ADAPTER_FILES and name not in IGNORED_FILES:
        raise invalid_adapter(f"the archive member {name!r} is not part of a PEFT LoRA adapter ({', '.join(ADAPTER_FILES)})")
    return name
