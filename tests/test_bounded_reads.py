"""Reads of stored files cost what they show, in a local store and in S3 alike: the dataset page
reads the examples it previews and no further, a file's content and an adapter's archive stream
through the ASGI server a block at a time, and an adapter's archive is built once per published
version, not on every download."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import os
import tarfile
import time
import tracemalloc
from pathlib import Path

import pytest

from finetuning import adapters, publishing, storage
from finetuning.models import File, FineTunedModel
from tests.inference_fixtures import BASE, register_fine_tuned_model
from tests.personas import chat_example
from tests.s3 import s3_server

pytestmark = pytest.mark.django_db(transaction=True)  # the ASGI handler reads the database in other threads

LARGE_BYTES = 20 * 1024 * 1024


@pytest.fixture(params=["local", "s3"])
def store_kind(request, settings, tmp_path):
    """The file store and the dynamic LoRA path: local folders, or buckets of a moto S3 server."""
    if request.param == "local":
        settings.CONFIG = dataclasses.replace(settings.CONFIG, files_path=str(tmp_path / "files"))
        lora_path = str(tmp_path / "adapters")
        yield from _with_stores(settings, lora_path)
        return
    with s3_server("bounded") as s3:
        settings.CONFIG = dataclasses.replace(settings.CONFIG, s3=s3, files_path="s3://bounded/files")
        yield from _with_stores(settings, "s3://bounded/adapters")


def _with_stores(settings, lora_path: str):
    catalog = settings.MODEL_CATALOG
    model = catalog.get(BASE)
    moved = dataclasses.replace(model, lora=dataclasses.replace(model.lora, dynamic_lora_loading_path=lora_path))
    settings.MODEL_CATALOG = dataclasses.replace(catalog, models=(moved,))
    storage.files.cache_clear()
    storage.adapters.cache_clear()
    yield settings.CONFIG.files_path
    storage.files.cache_clear()
    storage.adapters.cache_clear()


def _large_dataset() -> bytes:
    example = chat_example("Tell me about the weather. " * 40, "It is mild and dry today. " * 40)
    line = (json.dumps(example) + "\n").encode()
    return line * (LARGE_BYTES // len(line))


def _stored_file(persona, data: bytes, example_count: int) -> File:
    """A file as an upload leaves it (checked already: this test is about reading it back)."""
    file = File(
        organization=persona.organization, filename="large.jsonl", bytes=len(data), example_count=example_count,
        token_count=example_count * 300, max_example_tokens=300,
    )
    file.storage_key = f"files/{persona.organization.pk}/{file.id}.jsonl"
    storage.files().put(file.storage_key, data)
    file.save()
    return file


class ReadCounter:
    """Counts the bytes the platform reads from the file store (whole objects, or streams)."""

    def __init__(self, monkeypatch):
        self.read = 0
        store = storage.files()
        get = store.get
        monkeypatch.setattr(store, "get", lambda key: self._counted(get(key)))
        if hasattr(store, "open"):
            opened = store.open
            monkeypatch.setattr(store, "open", lambda key: _CountingStream(opened(key), self))

    def _counted(self, data: bytes) -> bytes:
        self.read += len(data)
        return data


class _CountingStream(io.RawIOBase):
    def __init__(self, inner, counter: ReadCounter):
        self.inner, self.counter = inner, counter

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.inner.read(len(buffer))
        buffer[: len(data)] = data
        self.counter.read += len(data)
        return len(data)

    def close(self) -> None:
        self.inner.close()
        super().close()


def test_the_dataset_page_reads_only_the_examples_it_shows(alice, client, store_kind, monkeypatch):
    data = _large_dataset()
    file = _stored_file(alice, data, example_count=data.count(b"\n"))
    client.force_login(alice.user)
    client.get("/datasets")  # the process's first page (templates, the store's client): not this test's subject
    counter = ReadCounter(monkeypatch)
    tracemalloc.start()
    started = time.perf_counter()
    try:
        response = client.get(f"/datasets/{file.id}")
        took = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    page = response.content.decode()
    print(f"\npreview of {len(data):,} bytes ({store_kind}): {took:.2f} s, peak {peak:,} B, read {counter.read:,} B")
    assert response.status_code == 200
    assert page.count('class="conversation"') == 5
    assert f"first 5 of {file.example_count} examples" in page  # the count stored at upload, not recounted
    assert counter.read < 1024 * 1024, f"read {counter.read:,} bytes of the store to show 5 examples"
    if store_kind.startswith("s3://"):
        return  # moto's server runs in this process, and copies the whole object to send it: not ours to count
    assert peak < 4 * 1024 * 1024, f"{peak:,} bytes at the peak"


def _asgi_get(path: str, key: str, counter: ReadCounter) -> tuple[int, dict, list[bytes], int]:
    """GET ``path`` through the platform's ASGI application, as uvicorn serves it: the status, the
    headers, each body message, and how much of the store had been read when the first one left."""
    from server.asgi import application

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"host", b"testserver"), (b"authorization", f"Bearer {key}".encode())],
        "client": ("127.0.0.1", 50000), "server": ("testserver", 80),
    }
    answer: dict = {"bodies": [], "read_at_first_body": None}
    requested = []

    async def receive():
        if not requested:
            requested.append(True)
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # the client stays connected until the answer ends

    async def send(message):
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
            answer["headers"] = {name.lower(): value for name, value in message["headers"]}
        elif message["type"] == "http.response.body" and message.get("body"):
            if answer["read_at_first_body"] is None:
                answer["read_at_first_body"] = counter.read
            answer["bodies"].append(message["body"])

    asyncio.run(application(scope, receive, send))
    return answer["status"], answer["headers"], answer["bodies"], answer["read_at_first_body"]


def test_a_files_content_streams_from_the_store_and_arrives_whole(alice, store_kind, monkeypatch):
    data = _large_dataset()
    file = _stored_file(alice, data, example_count=data.count(b"\n"))
    counter = ReadCounter(monkeypatch)
    status, headers, bodies, read_at_first_body = _asgi_get(f"/v1/files/{file.id}/content", alice.key, counter)
    print(f"\ncontent of {len(data):,} bytes ({store_kind}): {read_at_first_body:,} read before the first bytes left")
    assert status == 200 and headers[b"content-type"] == b"application/jsonl"
    assert b'filename="large.jsonl"' in headers[b"content-disposition"]
    assert b"".join(bodies) == data
    # The first bytes left before the file was read whole: it is streamed, not held in memory.
    assert read_at_first_body < 2 * 1024 * 1024, f"{read_at_first_body:,} bytes read before the first were sent"
    assert len(bodies) > 10


def _adapter_store():
    return publishing.store_for(BASE)


def _adapter(folder: Path, weights: bytes) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "base_model_name_or_path": BASE}))
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def _members(archive: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        return {member.name: tar.extractfile(member).read() for member in tar}


def test_an_adapters_archive_is_built_once_per_published_version(alice, store_kind, monkeypatch, tmp_path):
    name = register_fine_tuned_model(alice, f"archived-{time.time_ns()}")
    store = _adapter_store()
    store.publish(name, _adapter(tmp_path / "r1", b"first weights " * 50_000), 1)
    packed = []
    pack = adapters.pack
    monkeypatch.setattr(adapters, "pack", lambda folder, out: packed.append(folder) or pack(folder, out))
    url = f"/v1/fine_tuning/models/{name}/adapter"

    first, second = (b"".join(_body(alice.api.get(url))) for _ in range(2))
    assert len(packed) == 1, f"the archive was built {len(packed)} times for two downloads"
    assert first == second and _members(first)["adapter_model.safetensors"] == b"first weights " * 50_000

    # A new revision is a new archive; rolling back serves the first one again, without building it.
    store.publish(name, _adapter(tmp_path / "r2", b"second weights " * 50_000), 2)
    FineTunedModel.objects.filter(name=name).update(revision=2)
    second_revision = _members(b"".join(_body(alice.api.get(url))))
    assert second_revision["adapter_model.safetensors"] == b"second weights " * 50_000
    assert alice.api.post(f"/v1/fine_tuning/models/{name}/rollback", {"revision": 1}, format="json").status_code == 200
    assert b"".join(_body(alice.api.get(url))) == first
    assert len(packed) == 2
    store.delete(name)


def _body(response) -> list[bytes]:
    assert response.status_code == 200, response.content
    return list(response.streaming_content) if response.streaming else [response.content]


def test_an_adapters_archive_streams_through_the_asgi_server(alice, store_kind, monkeypatch, tmp_path):
    name = register_fine_tuned_model(alice, f"streamed-{time.time_ns()}")
    store = _adapter_store()
    weights = os.urandom(4 * 1024 * 1024)  # incompressible: an archive of 4 MB
    store.publish(name, _adapter(tmp_path / "r1", weights), 1)
    counter = ReadCounter(monkeypatch)  # here: the bytes read from the archive being sent
    model_archive = adapters.model_archive

    def counted(model):
        return io.BufferedReader(_CountingStream(model_archive(model), counter))

    monkeypatch.setattr(adapters, "model_archive", counted)
    url = f"/v1/fine_tuning/models/{name}/adapter"
    status, headers, bodies, read_at_first_body = _asgi_get(url, alice.key, counter)
    archive = b"".join(bodies)
    assert status == 200 and headers[b"content-type"] == b"application/gzip"
    assert _members(archive)["adapter_model.safetensors"] == weights
    read_first = f"{read_at_first_body:,} of {len(archive):,} bytes read before the first were sent"
    assert read_at_first_body < len(archive) / 2, read_first
    store.delete(name)


def test_the_archive_cache_removes_the_least_recently_used_past_its_size_and_an_open_one_stays_readable(tmp_path):
    from core.archive_cache import ArchiveCache

    cache, built = ArchiveCache(tmp_path / "archives", max_bytes=2500), []

    def build(content: bytes):
        def write(out) -> None:
            built.append(content)
            out.write(content)

        return write

    first = cache.open("first", build(b"1" * 1000))
    cache.open("second", build(b"2" * 1000)).close()
    time.sleep(0.01)
    cache.open("first", build(b"never")).close()  # kept: used again, so now the most recently used
    cache.open("third", build(b"3" * 1000)).close()  # 3,000 bytes: the least recently used goes
    assert built == [b"1" * 1000, b"2" * 1000, b"3" * 1000]
    assert cache.open("first", build(b"never")).read() == b"1" * 1000 and first.read() == b"1" * 1000
    assert cache.open("second", build(b"2 again")).read() == b"2 again"  # it was removed: built anew
    assert not list((tmp_path / "archives").glob(".building-*"))
