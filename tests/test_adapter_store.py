import json
import threading
from pathlib import Path

import pytest

from core.adapter_store import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterNotFound,
    CorruptAdapter,
    StoreUnavailable,
    adapter_store,
    sha256_of,
)
from tests.s3 import running_s3_server, s3_server

NAME = "HuggingFaceTB/SmolLM2-135M-Instruct:support-bot"


def _adapter(folder: Path, weights: bytes) -> Path:
    folder.mkdir(parents=True)
    (folder / WEIGHTS_FILE).write_bytes(weights)
    (folder / CONFIG_FILE).write_text(json.dumps({"base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}))
    return folder


@pytest.fixture(scope="module")
def s3():
    with s3_server("adapters") as settings:
        yield settings


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return adapter_store(str(tmp_path / "dynamic"), s3=None)
    return adapter_store(f"s3://adapters/run-{tmp_path.name}", request.getfixturevalue("s3"))


def test_a_published_adapter_is_fetched_whole(store, tmp_path):
    store.publish(NAME, _adapter(tmp_path / "out", b"weights-v1"))
    fetched = store.fetch(NAME, tmp_path / "cache")
    assert (fetched / WEIGHTS_FILE).read_bytes() == b"weights-v1"
    assert json.loads((fetched / CONFIG_FILE).read_text())["base_model_name_or_path"].startswith("HuggingFaceTB/")


def test_republishing_changes_the_version_and_the_bytes(store, tmp_path):
    first = store.publish(NAME, _adapter(tmp_path / "v1", b"one"))
    second = store.publish(NAME, _adapter(tmp_path / "v2", b"two"))
    assert first.version != second.version and store.version(NAME) == second
    assert (store.fetch(NAME, tmp_path / "cache") / WEIGHTS_FILE).read_bytes() == b"two"


def test_a_missing_or_deleted_adapter_is_not_found(store, tmp_path):
    assert store.version(NAME) is None
    store.publish(NAME, _adapter(tmp_path / "v1", b"one"))
    store.delete(NAME)
    assert store.version(NAME) is None
    with pytest.raises(AdapterNotFound):
        store.fetch(NAME, tmp_path / "cache")


def test_a_published_adapters_config_is_read_alone_and_a_missing_one_is_not_found(store, tmp_path):
    with pytest.raises(AdapterNotFound):
        store.config(NAME)
    store.publish(NAME, _adapter(tmp_path / "v1", b"one"))
    assert store.config(NAME) == {"base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    assert not (tmp_path / "cache").exists()  # nothing was downloaded for it
    store.delete(NAME)
    with pytest.raises(AdapterNotFound):
        store.config(NAME)


def test_a_folder_without_weights_is_refused_before_anything_is_written(store, tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / CONFIG_FILE).write_text("{}")
    with pytest.raises(FileNotFoundError, match=WEIGHTS_FILE):
        store.publish(NAME, tmp_path / "bad")
    assert store.version(NAME) is None


def test_local_readers_never_see_half_an_adapter(tmp_path):
    store = adapter_store(str(tmp_path / "dynamic"), s3=None)
    big = b"x" * (4 << 20)
    store.publish(NAME, _adapter(tmp_path / "v0", big))
    sources = [_adapter(tmp_path / f"v{i}", bytes([i]) * (4 << 20)) for i in range(1, 6)]
    seen: list[bytes] = []

    def read_while_publishing():
        while len(seen) < 200:
            published = store.path(NAME)
            seen.append((published / WEIGHTS_FILE).read_bytes() if (published / CONFIG_FILE).exists() else b"")

    reader = threading.Thread(target=read_while_publishing)
    reader.start()
    for source in sources:
        store.publish(NAME, source)
    reader.join()
    assert all(len(weights) == 4 << 20 and len(set(weights)) == 1 for weights in seen)


def test_s3_fetch_refuses_bytes_that_do_not_match_their_checksum(s3, tmp_path):
    store = adapter_store("s3://adapters/corrupt", s3)
    store.publish(NAME, _adapter(tmp_path / "v1", b"good"))
    # Overwrite the weights behind the store's back, keeping the old checksum metadata.
    head = store.client.head_object(Bucket="adapters", Key=store.key(NAME, WEIGHTS_FILE))
    store.client.put_object(Bucket="adapters", Key=store.key(NAME, WEIGHTS_FILE), Body=b"evil", Metadata=head["Metadata"])
    with pytest.raises(CorruptAdapter, match="checksum"):
        store.fetch(NAME, tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob(WEIGHTS_FILE))  # nothing half-downloaded is left


def test_s3_fetch_during_a_republish_retries_until_every_object_has_one_version(s3, tmp_path):
    store = adapter_store("s3://adapters/republishing", s3)
    store.publish(NAME, _adapter(tmp_path / "v1", b"one"))
    # Halfway through a republish: the new weights are up, the config still names the old version.
    new = _adapter(tmp_path / "v2", b"two")
    version = "9" * 19
    upload = {"Metadata": {"sha256": sha256_of(new / WEIGHTS_FILE), "version": version}}
    store.client.upload_file(str(new / WEIGHTS_FILE), "adapters", store.key(NAME, WEIGHTS_FILE), ExtraArgs=upload)
    upload = {"Metadata": {"sha256": sha256_of(new / CONFIG_FILE), "version": version}}
    config_last = threading.Timer(
        0.3, store.client.upload_file, (str(new / CONFIG_FILE), "adapters", store.key(NAME, CONFIG_FILE), upload)
    )
    config_last.start()
    fetched = store.fetch(NAME, tmp_path / "cache")
    config_last.join()
    assert fetched.name.endswith(f"@{version}")  # never the old name with the new bytes
    assert (fetched / WEIGHTS_FILE).read_bytes() == b"two"
    assert [folder.name for folder in fetched.parent.iterdir()] == [fetched.name]  # nothing mixed was cached


def test_s3_reads_while_s3_is_down_say_unavailable_not_missing_or_corrupt(tmp_path):
    with running_s3_server("outage") as server:
        store = adapter_store("s3://outage/x", server.settings)
        store.publish(NAME, _adapter(tmp_path / "v1", b"one"))
        server.stop()
        with pytest.raises(StoreUnavailable):
            store.version(NAME)
        with pytest.raises(StoreUnavailable):
            store.fetch(NAME, tmp_path / "cache")
        server.start()
        assert (store.fetch(NAME, tmp_path / "cache") / WEIGHTS_FILE).read_bytes() == b"one"


def test_an_s3_publish_while_s3_is_down_says_unavailable_and_readers_keep_the_last_version(tmp_path):
    with running_s3_server("outage-publish") as server:
        store = adapter_store("s3://outage-publish/x", server.settings)
        store.publish(NAME, _adapter(tmp_path / "v1", b"one"))
        server.stop()
        with pytest.raises(StoreUnavailable):
            store.publish(NAME, _adapter(tmp_path / "v2", b"two"))
        server.start()
        assert (store.fetch(NAME, tmp_path / "cache") / WEIGHTS_FILE).read_bytes() == b"one"


def test_a_local_publish_that_fails_leaves_no_partial_copy(tmp_path, monkeypatch):
    import errno
    import shutil

    store = adapter_store(str(tmp_path / "dynamic"), s3=None)
    store.publish(NAME, _adapter(tmp_path / "v1", b"one"))

    def disk_full(source, target, **kwargs):
        Path(target).write_bytes(b"par")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copy2", disk_full)
    with pytest.raises(OSError, match="No space"):
        store.publish(NAME, _adapter(tmp_path / "v2", b"two"))
    monkeypatch.undo()
    assert (store.path(NAME) / WEIGHTS_FILE).read_bytes() == b"one"
    assert not list((tmp_path / "dynamic").rglob(".staging-*"))


def test_every_publish_has_an_id_of_its_own_even_under_a_name_used_before(store, tmp_path):
    first = store.publish(NAME, _adapter(tmp_path / "v1", b"one"))
    second = store.publish(NAME, _adapter(tmp_path / "v2", b"two"))
    assert first.publish_id and second.publish_id and first.publish_id != second.publish_id
    assert store.version(NAME).publish_id == second.publish_id
    store.point(NAME, 1)  # a rollback answers with r1's own content, so with r1's id
    assert store.version(NAME).publish_id == first.publish_id == store.version(f"{NAME}@r1").publish_id
    store.delete(NAME)
    again = store.publish(NAME, _adapter(tmp_path / "v3", b"three"))  # r1 again, other bytes
    assert again.version == first.version and again.publish_id not in (first.publish_id, second.publish_id)


@pytest.mark.parametrize("name", [NAME, f"{NAME}@r1"])
def test_s3_a_deleted_adapters_cached_copy_never_answers_for_a_new_one_under_its_name(s3, tmp_path, name):
    # Alice's adapter is synced into the cache, then deleted; another organization publishes
    # other weights under the same name, which is its r1 too: the cache must not answer with alice's.
    store = adapter_store(f"s3://adapters/reused-{tmp_path.name}", s3)
    cache = tmp_path / "cache"
    store.publish(NAME, _adapter(tmp_path / "alice", b"alice's weights"))
    assert (store.fetch(name, cache) / WEIGHTS_FILE).read_bytes() == b"alice's weights"
    store.delete(NAME)
    store.publish(NAME, _adapter(tmp_path / "charlie", b"charlie's weights"))
    fetched = store.fetch(name, cache)
    assert (fetched / WEIGHTS_FILE).read_bytes() == b"charlie's weights"
    assert sha256_of(fetched / WEIGHTS_FILE) == sha256_of(tmp_path / "charlie" / WEIGHTS_FILE)
