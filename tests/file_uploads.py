"""Files through the API for tests: an upload as a client sends it, its error, and the keys the file
store was written under."""

from __future__ import annotations

import io

import pytest

from finetuning import storage


def upload(persona, data: bytes, name: str = "train.jsonl", purpose: str = "fine-tune"):
    return persona.api.post("/v1/files", {"file": _named(data, name), "purpose": purpose}, format="multipart")


def _named(data: bytes, name: str):
    handle = io.BytesIO(data)
    handle.name = name
    return handle


def error_of(response) -> dict:
    return response.json()["error"]


@pytest.fixture
def stored_keys(monkeypatch) -> list[str]:
    """The keys written to the file store during the test."""
    store, keys = storage.files(), []
    put_stream = store.put_stream  # what put and put_file call too

    def recording_put_stream(key: str, stream) -> None:
        keys.append(key)
        put_stream(key, stream)

    monkeypatch.setattr(store, "put_stream", recording_put_stream)
    return keys
