"""A LoRA adapter as one file to download or upload: a PEFT folder (``adapter_config.json`` and
``adapter_model.safetensors`` at its root) packed as ``.tar.gz``; uploads may be ``.zip`` too.

Unpacking trusts nothing in the archive: only regular files with the expected names, at the root
(``./`` is allowed), no absolute paths, no ``..``, no links or devices, no encrypted zip members; a
cap on the number of members and on the bytes written, counted as they are written (a zip's
declared sizes can lie), so an archive bomb stops at the cap. Headers are bounded before ``tarfile``
or ``zipfile`` reads them (``core.archive_limits``), so a header bomb costs no memory. A cut or
damaged archive (a CRC that does not match) is refused as such. Every refusal is
``invalid_adapter`` (or ``adapter_too_large``) naming the problem, and leaves nothing behind but
the (caller's, temporary) folder it was unpacking into.
"""

from __future__ import annotations

import bz2
import gzip
import io
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import IO

from core.adapter_store import CONFIG_FILE, WEIGHTS_FILE
from core.api_errors import ApiError, adapter_too_large, invalid_adapter, shown
from core.archive_limits import BLOCK, ArchiveTooLarge, UnsafeArchive, check_zip_directory, is_tar_header, scan_tar

ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
# What PEFT's save_pretrained writes beside the adapter (a model card): accepted, and not kept.
IGNORED_FILES = ("README.md",)
# A weights file that is not safetensors is a pickle, which can run code when it is loaded.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
MAX_MEMBERS = 8  # the two files, a README, a "./" entry: anything near this is not a PEFT folder
_CHUNK = 1 << 20
NOT_AN_ARCHIVE = "the file is not a readable .tar.gz or .zip archive"
# Compressions by their first bytes, as tarfile names them. Not xz: its header sets the memory its
# decoder takes (up to gigabytes).
_COMPRESSIONS = {b"\x1f\x8b": "gz", b"BZh": "bz2"}
_OPENERS: dict[str, Callable[[Path], io.BufferedIOBase]] = {  # the tar's bytes, decompressed as they are read
    "gz": lambda path: gzip.GzipFile(path, "rb"),
    "bz2": lambda path: bz2.BZ2File(path, "rb"),
    "": lambda path: path.open("rb"),
}
_ZIP_METHODS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2)  # not LZMA, for xz's reason
# What reading a damaged or cut archive raises: the decompressors' own errors (a bad gzip or bz2
# stream is an OSError), the archive modules', and EOFError where a compressed stream stops early.
_READ_ERRORS = (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError, OSError)

_Opener = Callable[[], IO[bytes]]  # opens a member for reading, once it has been checked


def pack(folder: Path, out: IO[bytes]) -> None:
    """Write the adapter in ``folder`` to ``out`` as a ``.tar.gz`` with the files at its root."""
    with tarfile.open(fileobj=out, mode="w:gz") as archive:
        for name in ADAPTER_FILES:
            archive.add(folder / name, arcname=name, recursive=False)


def unpack(archive: Path, into: Path, max_bytes: int) -> None:
    """Write the adapter files of ``archive`` (``.tar.gz`` or ``.zip``) into the folder ``into``."""
    written = 0
    names: set[str] = set()
    for name, size, stream in _members(archive, max_bytes):
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
        with _opened(stream) as source, (into / name).open("wb") as target:
            for block in _blocks(source):
                written += len(block)
                if written > max_bytes:
                    raise adapter_too_large(max_bytes)
                target.write(block)
    missing = [name for name in ADAPTER_FILES if name not in names]
    if missing:
        raise invalid_adapter(
            f"the archive has no {' and no '.join(missing)} at its root (a PEFT LoRA folder has both)"
        )


def _members(archive: Path, max_bytes: int) -> Iterator[tuple[str | None, int, _Opener]]:
    """Each member as (its checked name, or None for the root folder; its size; how to read it)."""
    kind = _kind(archive)
    if kind == "zip":
        yield from _zip_members(archive)
        return
    _check_tar_headers(archive, kind, max_bytes)
    try:
        with _OPENERS[kind](archive) as stream, tarfile.open(fileobj=stream, mode="r:") as tar:
            for count, member in enumerate(tar, start=1):
                _check_count(count)
                name = _checked_name(member.name, is_dir=member.isdir())
                if not (member.isfile() or (member.isdir() and name is None)):
                    what = "a symbolic link" if member.issym() else "a hard link" if member.islnk() else "not a file"
                    raise invalid_adapter(f"{_member(member.name)} is {what}; only regular files are accepted")
                yield name, member.size, _tar_opener(tar, member)
    except _READ_ERRORS as exc:
        raise _unreadable(exc) from None


def _kind(archive: Path) -> str:
    """How the archive is packed, from its first bytes: "zip", or tarfile's compression name."""
    with archive.open("rb") as file:
        head = file.read(BLOCK)
    if not head:
        raise invalid_adapter("the file is empty")
    for magic, kind in _COMPRESSIONS.items():  # before zip's test, which looks for its end record anywhere near the end
        if head.startswith(magic):
            return kind
    if zipfile.is_zipfile(archive):
        return "zip"
    if head.startswith(b"PK\x03\x04"):
        raise invalid_adapter("the .zip archive is cut short (its central directory, at the end, is missing)")
    if head.startswith(b"\xfd7zXZ\x00"):
        raise invalid_adapter("the archive is compressed with xz, which is not accepted; pack it as .tar.gz or .zip")
    if len(head) == BLOCK and is_tar_header(head):
        return ""  # an uncompressed tar
    raise invalid_adapter(NOT_AN_ARCHIVE)


def _check_tar_headers(archive: Path, kind: str, max_bytes: int) -> None:
    """Read the tar's raw headers before tarfile does (``core.archive_limits``): tarfile reads a
    long name or pax header whole, whatever size it declares."""
    opener = _OPENERS[kind]
    try:
        with opener(archive) as stream:
            scan_tar(stream, MAX_MEMBERS, max_bytes)
    except ArchiveTooLarge:
        raise adapter_too_large(max_bytes) from None
    except UnsafeArchive as exc:
        raise invalid_adapter(str(exc)) from None
    except _READ_ERRORS as exc:
        raise _unreadable(exc) from None


def _zip_members(archive: Path) -> Iterator[tuple[str | None, int, _Opener]]:
    try:
        with archive.open("rb") as file:
            check_zip_directory(file, MAX_MEMBERS)
        with zipfile.ZipFile(archive) as zip_file:
            for count, info in enumerate(zip_file.infolist(), start=1):
                _check_count(count)
                name = _checked_name(info.filename, is_dir=info.is_dir())
                if (info.external_attr >> 16) & 0o170000 == 0o120000:  # the Unix mode says "symlink"
                    raise invalid_adapter(
                        f"{_member(info.filename)} is a symbolic link; only regular files are accepted"
                    )
                if info.is_dir() and name is not None:
                    raise invalid_adapter(f"{_member(info.filename)} is a folder; the files must be at the root")
                if info.flag_bits & 0x1:
                    raise invalid_adapter(f"{_member(info.filename)} is encrypted; pack the files without a password")
                if info.compress_type not in _ZIP_METHODS:
                    raise invalid_adapter(
                        f"{_member(info.filename)} is compressed with a method not accepted "
                        f"(zip method {info.compress_type}); pack it with deflate, zip's usual method"
                    )
                yield name, info.file_size, _zip_opener(zip_file, info)
    except UnsafeArchive as exc:
        raise invalid_adapter(str(exc)) from None
    except _READ_ERRORS as exc:
        raise _unreadable(exc) from None


def _opened(opener: _Opener) -> IO[bytes]:
    """A member opened for reading; a damaged header of its own (a zip's local header) as a refusal."""
    try:
        return opener()
    except _READ_ERRORS as exc:
        raise _unreadable(exc) from None


def _blocks(source: IO[bytes]) -> Iterator[bytes]:
    """A member's bytes, block by block; a damaged or cut archive as a refusal naming that."""
    while True:
        try:
            block = source.read(_CHUNK)
        except _READ_ERRORS as exc:
            raise _unreadable(exc) from None
        if not block:
            return
        yield block


def _unreadable(exc: BaseException) -> ApiError:
    """The refusal for an archive its reader gave up on. The reader's own words stay out of it:
    they name library internals, not what the person can fix."""
    if isinstance(exc, EOFError):
        return invalid_adapter("the archive is cut short (truncated); upload the whole file again")
    if isinstance(exc, tarfile.ReadError) and not isinstance(exc, tarfile.CompressionError):
        return invalid_adapter(NOT_AN_ARCHIVE)
    return invalid_adapter(
        "the archive is damaged: its data does not decompress, or does not match its checksum (CRC); pack it again"
    )


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


def _member(raw: str) -> str:
    """A member for a message: its name quoted, and cut short (a name can be as long as the archive)."""
    return "the archive member " + _shown(raw)


def _shown(raw: str) -> str:
    return repr(shown(raw, most=80))


def _checked_name(raw: str, is_dir: bool) -> str | None:
    """The member's file name, when it is one of the adapter's at the root; None for the root itself."""
    path = PurePosixPath(raw.replace("\\", "/"))
    if path.is_absolute() or raw.startswith(("/", "\\")) or (len(raw) > 1 and raw[1] == ":"):
        raise invalid_adapter(f"{_member(raw)} has an absolute path; paths must be relative to the archive root")
    parts = [part for part in path.parts if part != "."]
    if ".." in parts:
        raise invalid_adapter(f"{_member(raw)} points outside the archive root ('..')")
    if not parts:
        return None
    if is_dir or len(parts) > 1:
        raise invalid_adapter(
            f"{_member(raw)} is not at the archive root; pack the folder's files, not the folder "
            "(tar -czf adapter.tar.gz -C <folder> adapter_config.json adapter_model.safetensors)"
        )
    name = parts[0]
    if name.endswith(PICKLE_SUFFIXES):
        raise invalid_adapter(
            f"{_shown(name)} is a pickle; only safetensors weights are accepted (save with safe_serialization=True, "
            f"as {WEIGHTS_FILE})"
        )
    if name not in ADAPTER_FILES and name not in IGNORED_FILES:
        raise invalid_adapter(f"{_member(name)} is not part of a PEFT LoRA adapter ({', '.join(ADAPTER_FILES)})")
    return name
