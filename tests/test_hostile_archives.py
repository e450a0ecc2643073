# ruff: noqa: F811 (pytest fixtures are imported, then named as arguments)
"""Hostile adapter archives at both doors that take one: the API (``POST /v1/fine_tuning/adapters``)
and the dashboard's upload form. Every kind of bad archive gets a 400 whose message names what is
wrong, nothing is written (no model row, nothing in the adapter store, no unpacking folder left),
and the web process's memory stays bounded: the Python memory allocated while the request is
handled (tracemalloc's peak, which sees every bytes, str and NumPy buffer) stays under
``MEMORY_BOUND``. A header bomb of ~100 MiB (a GNU long name or a pax header of 96 MiB, ~100 KiB
packed) or a zip listing 150,000 members is far over that bound if it is read whole. The bombs are
also unpacked in a fresh process, whose resident peak (memory outside Python's view included, such
as zlib's) must grow by less than the same bound.

The adapters here are tiny (rank 1, one module of one layer) and built with NumPy, so that each
cell's memory is the archive's doing, not the adapter's size.
"""

from __future__ import annotations

import io
import json
import lzma
import struct
import tempfile
import tracemalloc
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pytest

from core.adapter_store import CONFIG_FILE, WEIGHTS_FILE
from finetuning.models import FineTunedModel
from tests.adapter_archives import (
    A_NAME,
    B_NAME,
    HIDDEN,
    Q_OUT,
    config,
    field_of,
    files,
    send,
    tar_gz,
    upload_form,
    weights,
)
from tests.inference_fixtures import BASE, adapter_store
from tests.limits import own_counters  # noqa: F401 (a fixture: each test's upload counter is its own)

pytestmark = pytest.mark.django_db

MEMORY_BOUND = 64 * 1024 * 1024  # bytes of Python memory one hostile upload may cost the web process
BOMB = 96 * 1024 * 1024  # a header bomb's size once unpacked
SUFFIX = "hostile"
PEAKS: dict[str, int] = {}


# --- a tiny valid adapter, and ways to spoil it ------------------------------------------------


def bfloat16_weights(a_value: float) -> bytes:
    """A safetensors file with A in bfloat16 (NumPy has no bfloat16: its bytes are a float32's upper half)."""
    a = (np.full((1, HIDDEN), a_value, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
    b = np.full((Q_OUT, 1), 0.5, np.float32).astype("<f4").tobytes()
    header = {
        A_NAME: {"dtype": "BF16", "shape": [1, HIDDEN], "data_offsets": [0, len(a)]},
        B_NAME: {"dtype": "F32", "shape": [Q_OUT, 1], "data_offsets": [len(a), len(a) + len(b)]},
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + a + b


def a_of(value: float, dtype=np.float32) -> np.ndarray:
    return np.full((1, HIDDEN), value, dtype=dtype)


def b_with(value: float, dtype=np.float32) -> np.ndarray:
    b = np.full((Q_OUT, 1), 0.5, dtype=dtype)
    b[7, 0] = value
    return b


def zip_of(members: dict[str, bytes], symlinks: Iterable[str] = (), method: int = zipfile.ZIP_DEFLATED) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", method) as archive:
        for name, data in members.items():
            info = zipfile.ZipInfo(name)
            info.compress_type = method
            if name in symlinks:
                info.external_attr = 0o120777 << 16
            archive.writestr(info, data)
    return out.getvalue()


def encrypted_zip() -> bytes:
    """The "encrypted" flag set on every member, in its local header and in the central directory
    (zipfile writes no encrypted members: the flag is what a reader goes by)."""
    archive = bytearray(zip_of(files()))
    with zipfile.ZipFile(io.BytesIO(bytes(archive))) as listing:
        local_headers = [info.header_offset for info in listing.infolist()]
    for offset in local_headers:
        archive[offset + 6] |= 0x1
    position = archive.find(b"PK\x01\x02")
    while position >= 0:
        archive[position + 8] |= 0x1
        position = archive.find(b"PK\x01\x02", position + 4)
    return bytes(archive)


def stored_zip(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return out.getvalue()


def bad_crc_zip() -> bytes:
    """A member's bytes changed after its CRC was written (one bit flipped in transit)."""
    archive = stored_zip(files())
    return archive.replace(b'"lora_alpha": 2', b'"lora_alpha": 3', 1)


def bad_crc_gzip() -> bytes:
    """Every byte of the tar intact, the gzip trailer's CRC-32 wrong."""
    archive = bytearray(tar_gz(files()))
    archive[-8] ^= 0xFF
    return bytes(archive)


def tar_header(name: bytes, size: int, kind: bytes) -> bytes:
    """A raw ustar header block (tarfile refuses to write the hostile ones)."""
    header = bytearray(512)
    header[0 : len(name)] = name
    header[100:108] = b"0000644\0"
    header[108:116] = header[116:124] = b"0000000\0"
    header[124:136] = b"%011o\0" % size
    header[136:148] = b"%011o\0" % 0
    header[148:156] = b" " * 8
    header[156:157] = kind
    header[257:265] = b"ustar\x0000"
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header)


def padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % 512)


def gzipped(parts: Iterable[bytes | tuple[bytes, int]]) -> bytes:
    """gzip of ``parts``, each bytes or (a byte, how many times): a bomb packed without building it."""
    packer, out = zlib.compressobj(6, zlib.DEFLATED, 31), []
    for part in parts:
        if isinstance(part, tuple):
            byte, count = part
            chunk = byte * (1 << 20)
            for _ in range(count >> 20):
                out.append(packer.compress(chunk))
            out.append(packer.compress(byte * (count & ((1 << 20) - 1))))
        else:
            out.append(packer.compress(part))
    out.append(packer.flush())
    return b"".join(out)


def plain_tar(members: dict[str, bytes]) -> bytes:
    return b"".join([*plain_members(members), bytes(1024)])


def plain_members(members: dict[str, bytes]) -> list[bytes]:
    return [tar_header(name.encode(), len(data), b"0") + padded(data) for name, data in members.items()]


def header_bomb(kind: bytes) -> bytes:
    """A GNU long name (``L``) or pax (``x``) header of ``BOMB`` bytes before the adapter's files."""
    if kind == b"x":
        record_size = BOMB  # "<size> comment=aaa...\n", its size counting itself
        prefix = b"%d comment=" % record_size
        body: list[bytes | tuple[bytes, int]] = [prefix, (b"a", BOMB - len(prefix) - 1), b"\n"]
        name = b"././@PaxHeader"
    else:
        body, name = [(b"a", BOMB)], b"././@LongLink"
    return gzipped([tar_header(name, BOMB, kind), *body, *plain_members(files()), bytes(1024)])


def tar_count_bomb(count: int = 100_000) -> bytes:
    """The root folder's entry, over and over: each is a member tarfile keeps."""
    entry = tar_header(b"./", 0, b"5")
    return gzipped([entry * count, *plain_members(files()), bytes(1024)])


def zip_count_bomb(count: int = 150_000, declared: int | None = None) -> bytes:
    """One member, listed ``count`` times in the central directory; the end record says ``declared``."""
    name = CONFIG_FILE.encode()
    data = config()
    crc = zlib.crc32(data)
    local = struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0, crc, len(data), len(data), len(name), 0) + name
    entry = struct.pack(
        "<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, crc, len(data), len(data), len(name), 0, 0, 0, 0, 0, 0
    ) + name
    directory = entry * count
    listed = min(count if declared is None else declared, 0xFFFF)
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, listed, listed, len(directory), len(local) + len(data), 0)
    return local + data + directory + end


def tar_with_link(kind: bytes, target: bytes) -> bytes:
    header = bytearray(tar_header(WEIGHTS_FILE.encode(), 0, kind))
    header[157 : 157 + len(target)] = target
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return gzipped([*plain_members({CONFIG_FILE: config()}), bytes(header), bytes(1024)])


def sparse_tar() -> bytes:
    return gzipped([*plain_members({CONFIG_FILE: config()}), tar_header(WEIGHTS_FILE.encode(), 0, b"S"), bytes(1024)])


def duplicate_tar() -> bytes:
    parts = plain_members(files()) + plain_members({CONFIG_FILE: config(lora_alpha=4)})
    return gzipped([*parts, bytes(1024)])


def duplicate_zip() -> bytes:
    out = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(out, "w") as archive:
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate name, and writes it
        for name, data in [*files().items(), (CONFIG_FILE, config(lora_alpha=4))]:
            archive.writestr(name, data)
    return out.getvalue()


def alpha_written_as(text: bytes) -> bytes:
    """A config whose lora_alpha is ``text`` as written (json.dumps writes neither NaN's nor 1e400's way)."""
    return config().replace(b'"lora_alpha": 2', b'"lora_alpha": ' + text)


CASES: dict[str, tuple[Callable[[], bytes], str]] = {
    # case: (the uploaded file, words the refusal must hold)
    "truncated tar.gz": (lambda: tar_gz(files())[: len(tar_gz(files())) // 2], "cut short"),
    "truncated zip": (lambda: zip_of(files())[:-200], "cut short"),
    "bad CRC in a zip member": (bad_crc_zip, "damaged"),
    "bad CRC in the gzip trailer": (bad_crc_gzip, "damaged"),
    "encrypted zip members": (encrypted_zip, "encrypted"),
    "damaged zip member header": (lambda: b"PK\x03\x05" + zip_of(files())[4:], "damaged"),
    "GNU long name header bomb": (lambda: header_bomb(b"L"), "GNU long name"),
    "pax header bomb": (lambda: header_bomb(b"x"), "pax header"),
    "tar member-count bomb": (tar_count_bomb, "more than 8 members"),
    "zip member-count bomb": (zip_count_bomb, "more than 8 members"),
    "zip directory larger than it says": (lambda: zip_count_bomb(declared=2), "central directory"),
    "tar symlink": (lambda: tar_with_link(b"2", b"/etc/passwd"), "symbolic link"),
    "tar hard link": (lambda: tar_with_link(b"1", CONFIG_FILE.encode()), "hard link"),
    "zip symlink": (lambda: zip_of(files(), symlinks=[WEIGHTS_FILE]), "symbolic link"),
    "tar sparse member": (sparse_tar, "not a regular file"),
    "tar absolute path": (lambda: tar_gz(files() | {"/etc/evil.json": b"{}"}), "absolute path"),
    "tar .. path": (lambda: tar_gz(files() | {"../evil.json": b"{}"}), "outside the archive root"),
    "zip absolute path": (lambda: zip_of(files() | {"/etc/evil.json": b"{}"}), "absolute path"),
    "zip .. path": (lambda: zip_of(files() | {"../../evil.json": b"{}"}), "outside the archive root"),
    "tar duplicate names": (duplicate_tar, "twice"),
    "zip duplicate names": (duplicate_zip, "twice"),
    "deeply nested JSON config": (lambda: tar_gz(files(config=b"[" * 30_000 + b"]" * 30_000)), "nested"),
    "oversized config": (lambda: tar_gz(files(config=config(notes="x" * 200_000))), "adapter_config.json is"),
    "lora_alpha a string": (lambda: tar_gz(files(config=config(lora_alpha="x"))), "lora_alpha"),
    "lora_alpha NaN": (lambda: tar_gz(files(config=alpha_written_as(b"NaN"))), "NaN"),
    "lora_alpha past a float": (lambda: tar_gz(files(config=alpha_written_as(b"1e400"))), "lora_alpha is inf"),
    "r a boolean": (lambda: tar_gz(files(config=config(r=True))), "r (the LoRA rank)"),
    "r a float": (lambda: tar_gz(files(config=config(r=1.0))), "r (the LoRA rank)"),
    "lora_dropout out of range": (lambda: tar_gz(files(config=config(lora_dropout=7))), "lora_dropout"),
    "use_rslora a string": (lambda: tar_gz(files(config=config(use_rslora="yes"))), "use_rslora"),
    "NaN weights": (lambda: tar_gz(files(weights=weights(b=b_with(np.nan)))), B_NAME),
    "infinite half-precision weights": (lambda: tar_gz(files(weights=weights(a=a_of(np.inf, np.float16)))), A_NAME),
    "weights past half precision": (lambda: tar_gz(files(weights=weights(a=a_of(1e6)))), "65504"),
    "bfloat16 weights past half precision": (lambda: tar_gz(files(weights=bfloat16_weights(1e5))), A_NAME),
    "weights past half precision once scaled": (lambda: tar_gz(files(weights=weights(b=b_with(40_000.0)))), "lora_alpha / r"),
    "tar.xz (its header sets the decoder's memory)": (lambda: lzma.compress(plain_tar(files())), "xz"),
    "zip member compressed with LZMA": (lambda: zip_of(files(), method=zipfile.ZIP_LZMA), "method"),
    "not an archive": (lambda: b"just some bytes, " * 100, "not a readable .tar.gz or .zip"),
    "empty file": (lambda: b"", "empty"),
}


# --- the two doors -----------------------------------------------------------------------------


def posted(persona, archive: bytes, suffix: str = SUFFIX):
    return send(persona, archive, suffix)


def form_posted(web, archive: bytes, suffix: str = SUFFIX):
    return upload_form(web, archive, suffix)


def through_the_api(alice, web, archive: bytes) -> tuple[int, str]:
    response = posted(alice, archive)
    return response.status_code, response.json()["error"]["message"]


def through_the_form(alice, web, archive: bytes) -> tuple[int, str]:
    response = form_posted(web, archive)
    page = response.content.decode()
    return response.status_code, field_of(page, "file") if 'id="field-file"' in page else page


DOORS = {"api": through_the_api, "form": through_the_form}


@pytest.fixture
def web(client, alice, settings):
    settings.INFERENCE_POOL_URL = "http://127.0.0.1:9"  # which models are loaded does not matter here
    client.force_login(alice.user)
    return client


@pytest.fixture(autouse=True)
def _fresh_store():
    adapter_store().delete(f"{BASE}:{SUFFIX}")
    yield
    adapter_store().delete(f"{BASE}:{SUFFIX}")


@pytest.fixture(scope="module", autouse=True)
def _report_peaks():
    yield
    if PEAKS:
        print(f"\nPeak memory per hostile upload, bound {MEMORY_BOUND >> 20} MiB (door rows: Python's, tracemalloc;")
        print("process rows: a fresh process's resident peak, VmHWM, growth while it unpacks):")
        for cell, peak in sorted(PEAKS.items(), key=lambda item: -item[1]):
            print(f"  {peak / (1 << 20):8.2f} MiB  {cell}")


@pytest.fixture
def own_temp(tmp_path, monkeypatch) -> Path:
    """Temporary files of this test only, to see that a refused upload leaves none behind."""
    folder = tmp_path / "temp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def measured(upload: Callable[[], tuple[int, str]]) -> tuple[int, str, int]:
    tracemalloc.start()
    try:
        status, message = upload()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return status, message, peak


def test_the_tiny_adapter_itself_is_accepted_at_both_doors(alice, web, own_temp):
    """The control: every refusal below is the spoiling's doing."""
    for door, suffix in (("api", "hostile"), ("form", "hostile-form")):
        if door == "api":
            response = posted(alice, tar_gz(files()), suffix)
            assert response.status_code == 200, response.json()
        else:
            response = form_posted(web, tar_gz(files()), suffix)
            assert response.status_code == 302, response.content.decode()[:2000]
        assert adapter_store().version(f"{BASE}:{suffix}") is not None
        adapter_store().delete(f"{BASE}:{suffix}")


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("case", CASES)
def test_a_hostile_archive_is_a_400_naming_the_problem_writes_nothing_and_costs_bounded_memory(
    alice, web, own_temp, door, case
):
    make, expected = CASES[case]
    archive = make()
    status, message, peak = measured(lambda: DOORS[door](alice, web, archive))
    PEAKS[f"{door}: {case}"] = peak

    assert status == 400, (status, message[:2000])
    assert expected in message, message[:2000]
    assert "/tmp" not in message and "Traceback" not in message and len(message) < 4000, message[:2000]
    assert not FineTunedModel.objects.filter(suffix=SUFFIX).exists()
    assert adapter_store().version(f"{BASE}:{SUFFIX}") is None
    assert not [path.name for path in own_temp.iterdir() if path.name.startswith("adapter-upload-")]
    assert peak < MEMORY_BOUND, f"{peak / (1 << 20):.1f} MiB"


def test_a_bfloat16_adapter_within_half_precisions_range_is_accepted(alice, own_temp):
    """The value check reads bfloat16 (which NumPy cannot) as the float32 it stands for."""
    response = posted(alice, tar_gz(files(weights=bfloat16_weights(60_000.0))))
    assert response.status_code == 200, response.json()


# --- the header scan on its own (no web request) -----------------------------------------------


def unpacked_or_refusal(archive: bytes, tmp_path: Path) -> str:
    """"unpacked", or the refusal's message: ``core.adapter_archive.unpack`` alone."""
    from core.adapter_archive import unpack
    from core.api_errors import ApiError

    tmp_path.mkdir(exist_ok=True)
    path, into = tmp_path / "archive", tmp_path / "unpacked"
    path.write_bytes(archive)
    into.mkdir(exist_ok=True)
    try:
        unpack(path, into, 16 * 1024 * 1024)
    except ApiError as error:
        return error.message
    return "unpacked"


@pytest.mark.parametrize("tool", [
    ["tar", "-czf"], ["tar", "--format=posix", "-czf"], ["tar", "--format=gnu", "-cjf"], ["zip", "-q", "-j"],
])
def test_archives_packed_by_the_usual_tools_pass_the_header_scan(tool, tmp_path):
    import shutil
    import subprocess

    if shutil.which(tool[0]) is None:
        pytest.skip(f"no {tool[0]} here")
    folder = tmp_path / "adapter"
    folder.mkdir()
    for name, data in files().items():
        (folder / name).write_bytes(data)
    archive = tmp_path / "packed"
    names = [CONFIG_FILE, WEIGHTS_FILE]
    if tool[0] == "zip":
        subprocess.run([*tool, str(archive) + ".zip", *[str(folder / name) for name in names]], check=True)
        archive = archive.with_suffix(".zip")
    else:
        subprocess.run([*tool, str(archive), "-C", str(folder), *names], check=True)
    assert unpacked_or_refusal(archive.read_bytes(), tmp_path / "out") == "unpacked"


def pax_member(records: bytes, padding_records: bytes = b"") -> bytes:
    """A pax header (``records`` as its declared data, ``padding_records`` in its block padding) before the adapter."""
    data = records + padding_records
    return gzipped([tar_header(b"././@PaxHeader", len(records), b"x"), padded(data), *plain_members(files()), bytes(1024)])


def pax_record(keyword: bytes, value: bytes) -> bytes:
    body = b" " + keyword + b"=" + value + b"\n"
    size = len(body) + len(str(len(body)))
    size += len(str(size)) - len(str(len(body)))
    return b"%d" % size + body


def test_a_pax_header_that_sets_a_members_size_is_refused_even_in_its_padding(tmp_path):
    """tarfile takes a pax ``size`` over the header's own, and reads records in the block's padding:
    a size set either way would make it read the archive differently from the scan."""
    assert "pax header setting size" in unpacked_or_refusal(pax_member(pax_record(b"size", b"4096")), tmp_path)
    hidden = pax_member(pax_record(b"comment", b"hi"), padding_records=pax_record(b"size", b"4096"))
    assert "pax header setting size" in unpacked_or_refusal(hidden, tmp_path)
    assert unpacked_or_refusal(pax_member(pax_record(b"path", CONFIG_FILE.encode())), tmp_path) == "unpacked"


def test_an_old_style_folder_entry_hides_nothing_from_the_scan(tmp_path):
    """A regular-file entry named "x/" is a folder to tarfile, which reads no data after it, however
    large its declared size: the scan reads the next header where tarfile does, and sees the bomb."""
    folder = tar_header(b"x/", BOMB, b"\0")
    bomb = gzipped([folder, tar_header(b"././@LongLink", BOMB, b"L"), (b"a", BOMB), *plain_members(files()), bytes(1024)])
    assert "GNU long name header" in unpacked_or_refusal(bomb, tmp_path)


def test_a_zip64_end_record_listing_many_members_is_refused(tmp_path):
    """zipfile takes a zip64 end record's figures over the plain one's."""
    plain = zip_of(files())
    end = plain.rindex(b"PK\x05\x06")
    directory_at, directory_size = struct.unpack("<2L", plain[end + 12 : end + 20])
    record = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, 10**6, 10**6, directory_size, directory_at)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, end, 1)
    assert "1000000 listed" in unpacked_or_refusal(plain[:end] + record + locator + plain[end:], tmp_path)


# The same bound on a whole process's memory (tracemalloc sees Python's allocations only, not zlib's,
# bz2's or safetensors'): a fresh interpreter unpacks the bomb, and its peak resident size (Linux's
# VmHWM, reset to the current size once the imports are done) may grow by at most MEMORY_BOUND.
# Not ru_maxrss: Linux carries it over from the parent process across fork and exec.
_UNPACK_AND_MEASURE = """
import sys, tempfile
from pathlib import Path
from core.adapter_archive import unpack
from core.api_errors import ApiError

def kib(field):
    return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1])

with open("/proc/self/clear_refs", "w") as clear:
    clear.write("5")  # the peak (VmHWM) starts again from the current size
before = kib("VmRSS:")
with tempfile.TemporaryDirectory() as into:
    try:
        unpack(Path(sys.argv[1]), Path(into), 200 * 1024 * 1024)
    except ApiError as error:
        print(error.message[:200], file=sys.stderr)
print((kib("VmHWM:") - before) * 1024)
"""


@pytest.mark.parametrize("case", ["GNU long name header bomb", "pax header bomb", "zip member-count bomb", "tar member-count bomb"])
def test_a_bomb_grows_a_fresh_process_by_less_than_the_bound(case, tmp_path):
    import subprocess
    import sys

    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("measures with Linux's /proc")
    archive = tmp_path / "bomb"
    archive.write_bytes(CASES[case][0]())
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", _UNPACK_AND_MEASURE, str(archive)], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    growth = int(done.stdout)
    PEAKS[f"process: {case}"] = growth
    assert growth < MEMORY_BOUND, f"{growth / (1 << 20):.1f} MiB"
    assert CASES[case][1] in done.stderr, done.stderr
