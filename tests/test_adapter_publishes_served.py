"""A fine-tuned model's name deleted and used again, served by real engines from S3 (moto's server).

Alice's organization publishes ``<base>:x``; it answers, is evicted (one adapter per replica here),
and is deleted; charlie's organization then publishes other weights under the same name, which is
``r1`` again. Charlie's requests must get charlie's weights (token for token as PEFT), never the
copy of alice's adapter a replica's cache or engine kept, and no copy of an evicted or deleted
adapter stays on disk. A name published again while a replica holds it answers with the new weights
once S3 has said so, within seconds (docs/serving.md). Once on the embedded pool, once on Ray Serve
(both with their own S3 dynamic path and data folder); the gateway and the registry are not part of
it: the store is written as a publish and a delete write it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest

from core.adapter_store import S3AdapterStore
from inference.engine_contract import SERVER_MODULE
from tests.inference_fixtures import BASE, catalog_text, internal_headers, make_adapter  # noqa: F401 (fixture)
from tests.processes import ROOT, answers, free_port, running, wait_until
from tests.ray_nodes import ready_replicas
from tests.s3 import running_s3_server
from tests.served_answers import QUESTION, _peft_answer

BUCKET = "publishes"
NAME = f"{BASE}:x"
MAX_TOKENS = 16


@contextmanager
def _s3_host(tmp_path: Path, backend: str, autoscaling: str = "") -> Iterator[tuple[dict[str, str], S3AdapterStore]]:
    """The environment of a serving process with an S3 dynamic path and a data folder of its own
    (its adapter cache), a catalog of one adapter per replica, and the store it reads."""
    data = tmp_path / "data"
    data.mkdir()
    os.symlink(ROOT / "data" / "models", data / "models")
    catalog = tmp_path / "models.toml"
    text = catalog_text(backend, autoscaling=autoscaling)
    catalog.write_text(text.replace("max_num_adapters_per_replica = 3", "max_num_adapters_per_replica = 1"))
    with running_s3_server(BUCKET) as s3:
        environment = {
            "DATA_DIR": str(data), "MODEL_CATALOG": str(catalog), "DYNAMIC_LORA_PATH": f"s3://{BUCKET}/adapters",
            "S3_ENDPOINT_URL": s3.settings.endpoint_url, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
        }
        yield environment, S3AdapterStore(f"s3://{BUCKET}/adapters", s3.settings)


def _answer(url: str, model: str) -> dict:
    body = {"model": model, "messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=internal_headers(), timeout=180)
    assert response.status_code == 200, response.text
    return response.json()


def _text(answer: dict) -> str:
    return answer["choices"][0]["message"]["content"]


def _cached_copies(data: Path) -> list[str]:
    """The adapters with a copy in any adapter cache under ``data`` (the pool's, a Ray replica's)."""
    return sorted(path.parent.name for path in data.glob("adapter-cache*/**/adapter_model.safetensors"))


def _copies_held_only(data: Path, deleted: str) -> bool:
    """No copy of ``deleted``, and a copy of nothing else the engine does not hold. (A replica of one
    adapter may briefly hold two while one loads, and then evict either: which one stays is not the
    point, that no copy outlives its adapter is.)"""
    held = {name.rpartition("/")[2] for name in _loaded_in_vllm(data)}
    copies = [copy.rpartition("@")[0] for copy in _cached_copies(data)]  # less the publish id
    gone = deleted.rpartition("/")[2] + "@"
    return all(copy in held for copy in copies) and not any(copy.startswith(gone) for copy in copies)


def _copy_of(store: S3AdapterStore, name: str) -> str:
    """The cache folder's name for the publish the store has now under ``name`` (pinned to its
    revision: r1, or later when an earlier test of the session published the name in the same
    in-process S3)."""
    current = store.version(name)
    return f"{name.rpartition('/')[2]}@{current.version}@{current.identity}"


def _loaded_in_vllm(data: Path) -> set[str]:
    """The adapters the vLLM server that serves from ``data`` holds (found by its command line)."""
    server = next(
        process for process in psutil.process_iter(["cmdline"])
        if SERVER_MODULE in (process.info["cmdline"] or []) and str(data) in " ".join(process.info["cmdline"])
    )
    arguments = server.info["cmdline"]
    url = f"http://127.0.0.1:{arguments[arguments.index('--port') + 1]}"
    cards = httpx.get(f"{url}/v1/models", headers=internal_headers(), timeout=10).json()["data"]
    return {card["id"] for card in cards if card.get("parent")}


def _deleted_and_published_again(url: str, data: Path, store: S3AdapterStore, make_adapter) -> None:  # noqa: F811
    """The scenario of the module docstring, against ``url`` (the pool, or the Ray Serve app). What
    the new weights answer is read from the same engine under a name never used before (the same
    kernels, so token for token the same answer when the weights are the same)."""
    alice, charlie, other, dana = (make_adapter(seed=seed) for seed in (61, 62, 63, 64))
    store.publish(NAME, alice)
    alices = _answer(url, NAME)
    assert alices["model"] == f"{NAME}@r1" and _text(alices) == _peft_answer(alice, MAX_TOKENS)
    store.publish(f"{BASE}:other", other)
    _answer(url, f"{BASE}:other")  # x is evicted: one adapter per replica
    store.delete(NAME)
    wait_until(lambda: _cached_copies(data) == [_copy_of(store, f"{BASE}:other")], 15, "evicted copies to go")

    store.publish(NAME, charlie)  # another organization, the same name: r1 again
    charlies = _answer(url, NAME)
    assert charlies["model"] == f"{NAME}@r1"
    wait_until(lambda: _cached_copies(data) == [_copy_of(store, NAME)], 15, "all copies but the held one to go")

    # Deleted while held, and published again before the replica's next check. A replica trusts S3's
    # answer about a name for REMOTE_VERSION_TTL_S, and a request for a name it holds waits
    # KNOWN_VERSION_WAIT_S for S3 before answering with what it holds (on a busy machine, S3 here
    # may take longer): the new weights answer once S3 has said so, within seconds.
    store.delete(NAME)
    store.publish(NAME, dana)
    danas = _answer_once_changed(url, NAME, _text(charlies))

    assert _text(charlies) == _fresh_answer(url, store, charlie, "charlie-ref") != _text(alices)
    danas_own = _fresh_answer(url, store, dana, "dana-ref")
    # On a failure, which weights answered (on Ray, a replica once kept answering with charlie's).
    seen = lambda: {"alice": _text(alices), "charlie": _text(charlies), "base": _text(_answer(url, BASE))}  # noqa: E731
    assert _text(danas) == danas_own != _text(charlies), (_text(danas), danas_own, seen(), danas["model"])

    # Deleted, with no request after: it leaves the engine and the cache within seconds.
    _answer(url, NAME)  # held again
    store.delete(NAME)
    wait_until(lambda: f"{NAME}@r1" not in _loaded_in_vllm(data), 15, "the deleted adapter to leave the engine")
    wait_until(lambda: _copies_held_only(data, NAME), 15, "the deleted and evicted adapters' copies to go")


def _answer_once_changed(url: str, model: str, before: str, within_s: float = 30.0) -> dict:
    """The first answer other than ``before``, asking until ``within_s`` has passed (then the last)."""
    deadline = time.monotonic() + within_s
    while True:
        answer = _answer(url, model)
        if _text(answer) != before or time.monotonic() > deadline:
            return answer
        time.sleep(0.5)


def _fresh_answer(url: str, store: S3AdapterStore, folder: Path, suffix: str) -> str:
    """The engine's answer with the adapter in ``folder``, published under a name of its own."""
    store.publish(f"{BASE}:{suffix}", folder)
    return _text(_answer(url, f"{BASE}:{suffix}"))


@pytest.mark.engine
def test_on_the_pool_a_name_deleted_and_published_again_answers_with_the_new_weights(
    tmp_path, make_adapter, machine_to_itself  # noqa: F811
):
    with _s3_host(tmp_path, "embedded") as (environment, store):
        url = f"http://127.0.0.1:{free_port()}"
        environment |= {"INFERENCE_POOL_URL": url, "FIRST_REPLICA_PORT": str(free_port())}
        with running("pool-publishes", [sys.executable, "-m", "inference"], environment) as process:
            wait_until(lambda: answers(f"{url}/health", headers=internal_headers()), 300, "the pool", process)
            _deleted_and_published_again(url, Path(environment["DATA_DIR"]), store, make_adapter)


@pytest.mark.engine
def test_on_ray_a_name_deleted_and_published_again_answers_with_the_new_weights(
    tmp_path, make_adapter, machine_to_itself  # noqa: F811
):
    pytest.importorskip("ray")
    with _s3_host(tmp_path, "ray", autoscaling="min_replicas = 1\ncold_start_wait_s = 30") as (environment, store):
        serve_url = f"http://127.0.0.1:{free_port()}"
        environment |= {"RAY_SERVE_URL": serve_url}
        with running("ray-serve-publishes", [sys.executable, "-m", "inference.ray_serve"], environment) as process:
            wait_until(lambda: ready_replicas(serve_url) == 1, 420, "a Ray replica", process)
            _deleted_and_published_again(serve_url, Path(environment["DATA_DIR"]), store, make_adapter)
