"""Bounds on an archive's headers, checked before ``tarfile`` or ``zipfile`` reads it.

Both modules read some headers whole into memory before a caller sees a single member: ``tarfile``
a GNU long name or a pax header of any size it declares (a 100 MiB name packs into 100 KiB), and
the sparse maps of GNU sparse members; ``zipfile`` the whole central directory, with an object per
entry (millions of entries from a few MiB). So the raw headers are read here first, with small
caps, and the archive is refused (``UnsafeArchive``, saying what) before either module opens it.

The tar scan follows the archive as ``tarfile`` does (where each member's data starts and ends,
where the archive ends), so ``tarfile`` then reads only headers this scan has seen. It is stricter
where that is simpler: no pax ``size`` or sparse records, no device or sparse members.
"""

from __future__ import annotations

import struct
from typing import BinaryIO, Protocol

BLOCK = 512
MAX_HEADER_BYTES = 16 * 1024  # a GNU long name or pax header: a path and a few attributes take far less
MAX_TRAILING_BYTES = 1 << 20  # zeros after the end-of-archive blocks (tar pads to its 10 KiB records)
MAX_DIRECTORY_BYTES = 64 * 1024  # a zip's central directory: ~100 bytes an entry, a few entries
_CHUNK = 1 << 20

_META = {b"L": "a GNU long name", b"K": "a GNU long link name", b"x": "a pax", b"g": "a pax global"}
_REGULAR = (b"0", b"\0", b"7")  # what tarfile reads as a regular file (7: contiguous)
_WITHOUT_DATA = (b"1", b"2", b"5")  # hard link, symbolic link, folder: tarfile skips no data after them
_KINDS = {b"3": "a character device", b"4": "a block device", b"6": "a FIFO", b"S": "a sparse file",
          b"V": "a volume label", b"M": "a multi-volume continuation"}


class Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


class UnsafeArchive(ValueError):
    """What is wrong with the archive, in words for the person who sent it."""


class TruncatedArchive(UnsafeArchive):
    """It ends before its own structure says it does."""


class ArchiveTooLarge(UnsafeArchive):
    """Its files take more than the caller's limit once unpacked (the caller says which limit)."""

    def __init__(self) -> None:
        super().__init__("the archive's files are larger than allowed")


def scan_tar(stream: Readable, max_members: int, max_bytes: int) -> None:
    """Read the uncompressed tar ``stream`` to its end, header by header, refusing on the way a
    GNU long name or pax header over ``MAX_HEADER_BYTES``, a member that is not a file, folder or
    link, more than ``max_members`` members, and regular files over ``max_bytes`` in all (as
    declared: a tar's data is as long as its header says). Reading to the end lets a compressed
    stream check its own CRC."""
    members = headers = data_bytes = 0
    while True:
        block = _read(stream, BLOCK)
        if not block:
            break  # ended on a block boundary without the end-of-archive blocks: tarfile stops here too
        if len(block) < BLOCK:
            raise TruncatedArchive("the archive is cut short (it ends inside a header)")
        if block.count(0) == BLOCK:
            _drain(stream)
            break
        headers += 1
        if headers == 1 and not is_tar_header(block):
            raise UnsafeArchive("the file is compressed, but what it holds is not a tar archive")
        if headers > 4 * max_members:  # each member has at most a long name, a long link and a pax header
            raise UnsafeArchive(f"the archive holds more than {max_members} members")
        _check_checksum(block)
        kind, size = block[156:157], _number(block[124:136])
        if size < 0:
            raise UnsafeArchive("the archive is damaged (a header declares a negative size)")
        if kind in _META:
            _meta_header(stream, kind, size)
            continue
        members += 1
        if members > max_members:
            raise UnsafeArchive(f"the archive holds more than {max_members} members")
        name = block[:100].split(b"\0", 1)[0]
        if kind == b"\0" and name.endswith(b"/"):
            continue  # the old way to write a folder: tarfile reads it as one, with no data after it
        if kind in _WITHOUT_DATA:
            continue
        if kind not in _REGULAR:
            what = _KINDS.get(kind, f"of an unknown type ({kind!r})")
            shown = name[:80].decode("utf-8", "replace")
            raise UnsafeArchive(f"the archive member {shown!r} is {what}, not a regular file")
        if size > max_bytes - data_bytes:
            raise ArchiveTooLarge()
        data_bytes += size
        _skip(stream, _padded(size))


def check_zip_directory(archive: BinaryIO, max_members: int) -> None:
    """Refuse a zip whose end record (or zip64 end record) lists more than ``max_members`` entries,
    or a central directory over ``MAX_DIRECTORY_BYTES``: what ``zipfile`` would read whole. The end
    record is found as ``zipfile`` finds it (the last 22 bytes, else the last signature within a
    comment's reach)."""
    archive.seek(0, 2)
    size = archive.tell()
    end = _end_record(archive, size)
    if end is None:
        return  # zipfile finds none either, and says so
    position, record = end
    _, _, _, on_disk, entries, directory_bytes, _, _ = struct.unpack("<4s4H2LH", record)
    counts, sizes = [on_disk, entries], [directory_bytes]
    if position >= 20:  # a zip64 locator just before the end record: zipfile takes the zip64 record's figures
        archive.seek(position - 20)
        locator = archive.read(20)
        if locator[:4] == b"PK\x06\x07" and position >= 76:
            archive.seek(position - 76)
            record64 = archive.read(56)
            if record64[:4] == b"PK\x06\x06":
                on_disk64, entries64, directory64 = struct.unpack("<3Q", record64[24:48])
                counts += [on_disk64, entries64]
                sizes.append(directory64)
    if max(counts) > max_members:
        raise UnsafeArchive(f"the archive holds more than {max_members} members ({max(counts)} listed)")
    if max(sizes) > MAX_DIRECTORY_BYTES:
        raise UnsafeArchive(
            f"the archive's central directory takes {max(sizes)} bytes, more than {max_members} members need "
            f"(at most {MAX_DIRECTORY_BYTES} accepted)"
        )


def _end_record(archive: BinaryIO, size: int) -> tuple[int, bytes] | None:
    """(position, the 22 bytes) of the end-of-central-directory record zipfile would use."""
    if size < 22:
        return None
    archive.seek(size - 22)
    record = archive.read(22)
    if record[:4] == b"PK\x05\x06" and record[-2:] == b"\0\0":
        return size - 22, record
    start = max(size - 22 - 0xFFFF, 0)
    archive.seek(start)
    tail = archive.read()
    found = tail.rfind(b"PK\x05\x06")
    if found < 0 or len(tail) - found < 22:
        return None
    return start + found, tail[found : found + 22]


def _meta_header(stream: Readable, kind: bytes, size: int) -> None:
    if size > MAX_HEADER_BYTES:
        raise UnsafeArchive(
            f"the archive has {_META[kind]} header of {size} bytes; at most {MAX_HEADER_BYTES} are accepted "
            "(an adapter's files need short names and no extended attributes)"
        )
    data = _read(stream, _padded(size))
    if len(data) < _padded(size):
        raise TruncatedArchive("the archive is cut short (it ends inside a header)")
    if kind in (b"x", b"g"):
        for keyword in _pax_keywords(data):  # padding included: tarfile reads records there too
            if keyword == b"size" or keyword.startswith(b"GNU.sparse"):
                raise UnsafeArchive(
                    f"the archive has a pax header setting {keyword.decode('ascii', 'replace')}; "
                    "an adapter's files need neither sizes past 8 GiB nor sparse storage"
                )


def _pax_keywords(data: bytes) -> list[bytes]:
    """The keywords of pax records ("<length> <keyword>=<value>\\n", the length counting itself)."""
    malformed = UnsafeArchive("the archive is damaged (a pax header is malformed)")
    keywords, position = [], 0
    while position < len(data) and data[position] != 0:
        space = data.find(b" ", position)
        if space < 0 or not data[position:space].isdigit():
            raise malformed
        length = int(data[position:space])
        record = data[space + 1 : position + length]
        if length <= 0 or not record.endswith(b"\n") or b"=" not in record:
            raise malformed
        keywords.append(record.split(b"=", 1)[0])
        position += length
    return keywords


def is_tar_header(block: bytes) -> bool:
    """Whether the 512 bytes are a tar header, by tarfile's test: the checksum (the sum of the
    header's bytes with the checksum field as spaces) matches."""
    try:
        declared = _number(block[148:156])
    except UnsafeArchive:
        return False
    unsigned = 256 + sum(block[:148]) + sum(block[156:])
    signed = 256 + sum(struct.unpack("148b", block[:148])) + sum(struct.unpack("356b", block[156:]))
    return declared in (unsigned, signed)


def _check_checksum(block: bytes) -> None:
    if not is_tar_header(block):
        raise UnsafeArchive("the archive is damaged (a header's checksum does not match)")


def _number(field: bytes) -> int:
    """A header's number as tarfile reads it: octal digits, or GNU's base-256 for large values."""
    if field[0] in (0o200, 0o377):
        value = int.from_bytes(field[1:], "big")
        return value - 256 ** (len(field) - 1) if field[0] == 0o377 else value
    digits = field.split(b"\0", 1)[0].strip()
    try:
        return int(digits or b"0", 8)
    except ValueError:
        raise UnsafeArchive("the archive is damaged (a header holds a malformed number)") from None


def _padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def _read(stream: Readable, size: int) -> bytes:
    """Up to ``size`` bytes: fewer only at the end of the stream."""
    parts, wanted = [], size
    while wanted:
        part = stream.read(wanted)
        if not part:
            break
        parts.append(part)
        wanted -= len(part)
    return b"".join(parts)


def _skip(stream: Readable, size: int) -> None:
    while size:
        part = stream.read(min(size, _CHUNK))
        if not part:
            raise TruncatedArchive("the archive is cut short (a file's data ends early)")
        size -= len(part)


def _drain(stream: Readable) -> None:
    """Read what follows the end-of-archive blocks (padding), so a compressed stream checks its CRC."""
    left = MAX_TRAILING_BYTES
    while part := stream.read(min(_CHUNK, left + 1)):
        left -= len(part)
        if left < 0:
            raise UnsafeArchive(f"the archive has more than {MAX_TRAILING_BYTES} bytes after its end")
