"""Adapters in and out against the real engine: an uploaded adapter answers on its first request,
and a downloaded one gives PEFT the served model's greedy answer, token for token."""

# ruff: noqa: F811 (pytest fixtures are imported from tests.inference_fixtures, then named as arguments)
from __future__ import annotations

import io
import tarfile
import time

import httpx
import pytest

from tests.inference_fixtures import BASE, alice, gateway, make_adapter  # noqa: F401 (fixtures)
from tests.served_answers import _ask, _peft_answer, _suffix

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]


def test_an_uploaded_adapter_is_served_on_its_first_request_and_downloads_as_peft_serves_it(alice, gateway, make_adapter, tmp_path):
    folder = make_adapter(seed=3)
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            tar.add(folder / file, arcname=file)
    headers = {"Authorization": f"Bearer {alice.api_key}"}
    suffix = _suffix("uploaded")
    uploaded = httpx.post(
        f"{gateway}/v1/fine_tuning/adapters", headers=headers, timeout=120,
        files={"file": ("adapter.tar.gz", archive.getvalue())}, data={"model": BASE, "suffix": suffix},
    )
    assert uploaded.status_code == 200, uploaded.text
    name = uploaded.json()["id"]

    started = time.perf_counter()
    served = _ask(alice.client, name, max_tokens=16)  # its first request
    assert time.perf_counter() - started < 30
    assert served != _ask(alice.client, BASE, max_tokens=16)

    download = httpx.get(f"{gateway}/v1/fine_tuning/models/{name}/adapter", headers=headers, timeout=120)
    assert download.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(download.content), mode="r:gz") as tar:
        tar.extractall(tmp_path / "downloaded", filter="data")
    assert _peft_answer(tmp_path / "downloaded", max_tokens=16) == served
