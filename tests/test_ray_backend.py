"""The Ray Serve backend (``inference.ray_serve``): a catalog model with ``backend = "ray"`` is
served by a Ray Serve application, behind the same gateway, with the same answers.

The fast tests check what the backend takes from the catalog and how the gateway routes to it.
The engine tests start ``python -m inference.ray_serve`` (a one-node Ray cluster of its own, the
model scaled to zero) and a gateway whose catalog sends the model there, and drive them with the
official client: the cold start, an adapter on its first request token for token as PEFT, a
stream, JSON schemas, a republished revision, the pool's metrics series, and what it refuses.
"""

# ruff: noqa: F811 (pytest fixtures are imported from tests.inference_fixtures, then named as arguments)
from __future__ import annotations

import contextlib
import json
import sys
from collections import Counter
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from core.catalog import load_catalog
from core.env import ConfigError
from inference.engine_contract import SERVER_MODULE
from tests import mix_cases
from tests.eval_fixtures import capitals
from tests.fine_tuning_jobs import _publish_revision
from tests.inference_fixtures import (  # noqa: F401 (fixtures)
    BASE,
    Persona,
    _persona,
    adapter_store,
    catalog_text,
    internal_headers,
    make_adapter,
    monitoring_headers,
    publish_fine_tuned_model,
)
from tests.processes import ROOT, answers, free_port, running, running_web, wait_until
from tests.served_answers import PLACE_FORMAT, QUESTION, _peft_answer, _suffix, usage_reported
from tests.tool_calling import TWO_CITIES, assembled_tool_calls

RAY_CATALOG = ROOT / "data" / "test" / "ray-models.toml"
COLD_START_WAIT_S = 5  # a request waits this long for a starting replica: the first gets a 503


def _catalog_text(backend: str = "ray", min_replicas: int = 0, idle: str = "stop") -> str:
    autoscaling = f'min_replicas = {min_replicas}\ntarget_ongoing_requests = 8\ndownscale_delay_s = 600\nidle = "{idle}"\n'
    return catalog_text(backend, autoscaling=autoscaling + f"cold_start_wait_s = {COLD_START_WAIT_S}")


def _load(tmp_path: Path, text: str):
    path = tmp_path / "models.toml"
    path.write_text(text)
    return load_catalog(path, tmp_path, str(tmp_path / "adapters"))


# --- from the catalog -----------------------------------------------------------------------------


def test_the_catalog_names_each_models_backend_and_refuses_an_unknown_one(tmp_path):
    catalog = _load(tmp_path, _catalog_text())
    assert catalog.get(BASE).backend == "ray"
    assert catalog.served_by("ray").ids == [BASE] and catalog.served_by("embedded").ids == []
    assert _load(tmp_path, _catalog_text().replace('backend = "ray"\n', "")).get(BASE).backend == "embedded"
    with pytest.raises(ConfigError, match=r"backend must be one of 'embedded', 'ray', not 'kubernetes'"):
        _load(tmp_path, _catalog_text(backend="kubernetes"))


def test_the_catalog_says_what_a_model_scaled_to_zero_keeps_asleep_by_default_and_refuses_another_word(tmp_path):
    assert _load(tmp_path, _catalog_text().replace('idle = "stop"\n', "")).get(BASE).autoscaling.idle == "sleep"
    with pytest.raises(ConfigError, match=r"autoscaling\.idle must be one of 'sleep', 'stop', not 'nap'"):
        _load(tmp_path, _catalog_text(idle="nap"))
    with pytest.raises(ConfigError, match=r"autoscaling\.idle must be a str, not 0"):
        _load(tmp_path, _catalog_text().replace('idle = "stop"', "idle = 0"))


def test_the_catalogs_autoscaling_becomes_serves_autoscaling_config(tmp_path):
    from inference.ray_serve.app import replica_options

    options = replica_options(_load(tmp_path, _catalog_text(min_replicas=0)).get(BASE))
    assert options["autoscaling_config"] | {"upscale_delay_s": None} == {
        "min_replicas": 0, "initial_replicas": 0, "max_replicas": 1, "target_ongoing_requests": 8,
        "downscale_delay_s": 600, "upscale_delay_s": None,
    }
    assert options["ray_actor_options"] == {"num_cpus": 1}
    assert options["max_ongoing_requests"] >= 8
    assert "/" not in options["name"]
    # Scaled to zero asleep: Serve keeps one replica, whose engine sleeps while idle.
    asleep = replica_options(_load(tmp_path, _catalog_text(min_replicas=0, idle="sleep")).get(BASE))
    assert (asleep["autoscaling_config"]["min_replicas"], asleep["autoscaling_config"]["initial_replicas"]) == (1, 1)


def test_the_gateway_sends_a_ray_models_requests_to_ray_serve_and_the_others_to_the_pool(settings, tmp_path):
    from base.serving_client import serving_url

    settings.MODEL_CATALOG = _load(tmp_path, _catalog_text())
    settings.RAY_SERVE_URL, settings.INFERENCE_POOL_URL = "http://ray:8400/", "http://pool:8100"
    assert serving_url(f"{BASE}:tuned@r2", "/v1/chat/completions") == "http://ray:8400/v1/chat/completions"
    assert serving_url(BASE, "/v1/completions") == "http://ray:8400/v1/completions"
    settings.MODEL_CATALOG = _load(tmp_path, _catalog_text(backend="embedded"))
    assert serving_url(f"{BASE}:tuned", "/v1/chat/completions") == "http://pool:8100/v1/chat/completions"


# --- adapters on Ray replicas, by publish (a fake vLLM server, no engine) -------------------------


def _publish_alices(store, tmp_path: Path) -> tuple[str, bytes]:
    """Alice's organization's adapter, published as ``<base>:x``; its name and weights."""
    from tests.fake_pool import _adapter_folder

    name, alice = f"{BASE}:x", _adapter_folder(tmp_path / "alice")
    store.publish(name, alice)
    return name, (alice / "adapter_model.safetensors").read_bytes()


def test_ray_routes_a_name_deleted_and_published_again_as_another_model(tmp_path, monkeypatch):
    import asyncio

    from core.adapter_store import store_of
    from inference import adapter_source
    from inference.ray_serve.ingress import Ingress
    from tests.fake_pool import _adapter_folder

    monkeypatch.setattr(adapter_source, "REMOTE_VERSION_TTL_S", 0.0)
    model = _load(tmp_path, _catalog_text()).get(BASE)
    ingress = Ingress({}, (model,), "test")
    store = store_of(model, None)
    name, _ = _publish_alices(store, tmp_path)
    alices = asyncio.run(ingress._pinned(model, name))
    store.delete(name)
    store.publish(name, _adapter_folder(tmp_path / "charlie"))  # charlie's organization: r1 again
    charlies = asyncio.run(ingress._pinned(model, name))
    assert alices != charlies  # Ray would send charlie's requests to the replica holding alice's adapter
    assert alices[0] == charlies[0] == f"{name}@r1"  # what vLLM answers under, for both


@pytest.fixture(scope="module")
def s3():
    from tests.s3 import s3_server

    with s3_server("ray-adapters") as settings:
        yield settings


@dataclass
class ReplicaUnderTest:
    adapters: object
    vllm: object
    store: object
    cache: Path

    def held(self) -> dict:
        return self.vllm.loaded.get("http://replica", {})

    def cached_weights(self) -> list[Path]:
        return sorted(self.cache.rglob("adapter_model.safetensors"))

    async def routing_id(self, name: str) -> str:
        from core.model_names import pinned_name
        from inference.ray_serve.replica_adapters import routing_id

        found = self.store.version(name)
        return routing_id(pinned_name(name, found.version), found.identity)


def _replica_under_test(tmp_path: Path, s3) -> ReplicaUnderTest:
    from core.adapter_store import adapter_store as store_for
    from inference.adapter_source import AdapterSource
    from inference.metrics import Metrics
    from inference.ray_serve.replica_adapters import ReplicaAdapters
    from inference.server import admin_client
    from tests.fake_pool import TOKEN, FakeVllm

    store = store_for(f"s3://ray-adapters/{tmp_path.name}", s3)
    vllm = FakeVllm()
    admin = admin_client(TOKEN, transport=httpx.MockTransport(vllm.handler))
    source = AdapterSource(store, tmp_path / "cache", Metrics(), BASE)
    adapters = ReplicaAdapters(source, admin, "http://replica", 16, 3)
    return ReplicaUnderTest(adapters, vllm, store, tmp_path / "cache")


@pytest.fixture
def no_unload_grace(monkeypatch):
    from inference import adapter_slots, adapter_source

    monkeypatch.setattr(adapter_slots, "UNLOAD_GRACE_S", 0.0)
    monkeypatch.setattr(adapter_source, "REMOTE_VERSION_TTL_S", 0.0)


def test_a_ray_replica_never_answers_a_new_model_with_a_deleted_ones_weights_and_keeps_no_copy(
    tmp_path, s3, no_unload_grace
):
    import asyncio

    from tests.fake_pool import _adapter_folder

    async def scenario() -> None:
        replica = _replica_under_test(tmp_path, s3)
        name, alices = _publish_alices(replica.store, tmp_path)
        alices_entry = await replica.adapters.load(await replica.routing_id(name))
        assert (Path(replica.held()[f"{name}@r1"]) / "adapter_model.safetensors").read_bytes() == alices
        replica.store.delete(name)
        charlie = _adapter_folder(tmp_path / "charlie")
        replica.store.publish(name, charlie)  # before the replica's next check: it still holds alice's
        await replica.adapters.load(await replica.routing_id(name))
        weights = (Path(replica.held()[f"{name}@r1"]) / "adapter_model.safetensors").read_bytes()
        assert weights == (charlie / "adapter_model.safetensors").read_bytes() != alices
        await alices_entry.__del__()  # Ray evicts alice's id later: charlie's adapter stays
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert f"{name}@r1" in replica.held() and len(replica.cached_weights()) == 1
        replica.adapters.stop()

    asyncio.run(scenario())


def test_a_ray_replica_loads_the_publish_the_ingress_routed_though_its_own_answer_from_s3_is_older(tmp_path, s3):
    """The replica trusts S3's answer about a name for a second, and Ray keeps a routed id as loaded:
    a republish seen by the ingress first must not leave the old weights under the new id."""
    import asyncio

    from tests.fake_pool import _adapter_folder

    async def scenario() -> None:
        replica = _replica_under_test(tmp_path, s3)
        name, alices = _publish_alices(replica.store, tmp_path)
        await replica.adapters.load(await replica.routing_id(name))  # its source now knows alice's publish
        replica.store.delete(name)
        dana = _adapter_folder(tmp_path / "dana")
        replica.store.publish(name, dana)
        await replica.adapters.load(await replica.routing_id(name))  # within the second: the ingress saw dana's
        weights = (Path(replica.held()[f"{name}@r1"]) / "adapter_model.safetensors").read_bytes()
        assert weights == (dana / "adapter_model.safetensors").read_bytes() != alices
        replica.adapters.stop()

    asyncio.run(scenario())


def test_a_ray_replica_unloads_evicted_and_deleted_adapters_and_drops_their_cached_copies(
    tmp_path, s3, no_unload_grace
):
    import asyncio

    from tests.fake_pool import _adapter_folder

    async def scenario() -> None:
        replica = _replica_under_test(tmp_path, s3)
        names = [f"{BASE}:s{i}" for i in range(3)]
        for index, name in enumerate(names):
            replica.store.publish(name, _adapter_folder(tmp_path / f"s{index}"))
        evicted, deleted, kept = [await replica.adapters.load(await replica.routing_id(name)) for name in names]
        assert len(replica.cached_weights()) == 3
        await evicted.__del__()  # as Ray's least-recently-used eviction calls it
        replica.store.delete(names[1])  # no request for it: the replica's own check finds it gone
        deadline = time.monotonic() + 10
        while len(replica.held()) > 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert set(replica.held()) == {f"{names[2]}@r1"}
        assert time.monotonic() < deadline - 5  # within seconds (one check every RECHECK_HELD_S)
        assert [path.parent for path in replica.cached_weights()] == [Path(replica.held()[f"{names[2]}@r1"])]
        assert kept.name == f"{names[2]}@r1" and deleted.name == f"{names[1]}@r1"
        replica.adapters.stop()

    asyncio.run(scenario())


# --- served ---------------------------------------------------------------------------------------


@dataclass
class RayStack:
    serve_url: str
    gateway: str
    pid: int  # ``python -m inference.ray_serve``'s: Ray's processes, and the replicas' engines, descend from it


@pytest.fixture(scope="module")
def ray_stack(test_database_url, machine_to_itself) -> Iterator[RayStack]:
    """``python -m inference.ray_serve`` and a gateway in front of it, for this module's tests."""
    RAY_CATALOG.parent.mkdir(parents=True, exist_ok=True)
    RAY_CATALOG.write_text(_catalog_text())
    serve_url = f"http://127.0.0.1:{free_port()}"
    environment = {"MODEL_CATALOG": str(RAY_CATALOG), "RAY_SERVE_URL": serve_url}
    with running("ray-serve", [sys.executable, "-m", "inference.ray_serve"], environment) as process:
        wait_until(lambda: answers(f"{serve_url}/health", headers=internal_headers()), 240, "Ray Serve", process)
        with running_web("ray-gateway", {"DATABASE_URL": test_database_url, **environment}) as gateway:
            yield RayStack(serve_url, gateway, process.pid)


@pytest.fixture
def dana(transactional_db, ray_stack) -> Persona:
    """Calls the Ray-backed gateway."""
    return _persona("dana", ray_stack.gateway)


def _health(stack: RayStack) -> dict:
    return httpx.get(f"{stack.serve_url}/health", headers=internal_headers(), timeout=10).json()


def _held_on_ray(stack: RayStack) -> set[str]:
    """The adapters the engines of the stack's Ray replicas hold, as their vLLM servers list them."""
    held = set()
    for process in psutil.Process(stack.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            arguments = process.cmdline()
            if SERVER_MODULE in arguments:
                url = f"http://127.0.0.1:{arguments[arguments.index('--port') + 1]}/v1/models"
                cards = httpx.get(url, headers=internal_headers(), timeout=10).json()["data"]
                held |= {card["id"] for card in cards if card.get("parent")}
    return held


def _warm(persona: Persona) -> None:
    """Until the base model has a ready replica (it scales to zero): a 503 while one starts."""
    deadline = time.monotonic() + 240
    while True:
        try:
            _ask(persona, BASE, max_tokens=1)
            return
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and time.monotonic() < deadline, exc.body
            time.sleep(2)


def _ask(persona: Persona, model: str, max_tokens: int = 16, **extra) -> openai.types.chat.ChatCompletion:
    return persona.client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=max_tokens, temperature=0, **extra
    )


@pytest.mark.engine
@pytest.mark.django_db(transaction=True)
def test_a_model_scaled_to_zero_on_ray_starts_for_its_first_request(dana, ray_stack):
    assert _health(ray_stack)["models"][BASE] == {"state": "cold", "ready_replicas": 0}
    requested, refusals = time.monotonic(), []
    while True:
        try:
            answer = _ask(dana, BASE, max_tokens=4)
            break
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and exc.body["code"] == "model_starting", exc.body
            refusals.append(exc)
            time.sleep(min(int(exc.response.headers["Retry-After"]), 2))
    print(
        f"\nRay Serve cold start, from zero replicas to the first answer (4 tokens): {time.monotonic() - requested:.1f} s"
    )
    assert answer.choices[0].message.content
    assert refusals, f"a CPU engine does not start within the {COLD_START_WAIT_S} s a request waits"
    assert _health(ray_stack)["models"][BASE] == {"state": "ready", "ready_replicas": 1}
    cards = {card.id: card for card in dana.client.models.list().data}
    assert cards[BASE].model_extra["serving"] == {"state": "loaded", "replicas": 1}
    health = httpx.get(f"{ray_stack.gateway}/healthz", headers=monitoring_headers(), timeout=30).json()
    assert health["checks"]["inference_pool"] == {"ok": True, "detail": f"Ray Serve: {BASE} ready, 1 ready"}


@pytest.mark.engine
@pytest.mark.django_db(transaction=True)
def test_ray_serves_an_adapter_on_its_first_request_token_for_token_as_peft(dana, make_adapter):
    folder = make_adapter(seed=2)
    name = publish_fine_tuned_model(dana, _suffix("ray-peft"), folder)
    answer = _ask(dana, name)
    assert answer.model == f"{name}@r1"  # pinned to the revision, as the embedded pool does
    assert answer.choices[0].message.content == _peft_answer(folder, max_tokens=16)
    assert answer.choices[0].message.content != _ask(dana, BASE).choices[0].message.content
    assert answer.usage.prompt_tokens > 0 and answer.usage.completion_tokens > 0


def _platform_metric(stack: RayStack, sample: str, **labels: str) -> float:
    """The sum of a sample's values over the series with these labels, in the platform's /metrics."""
    text = httpx.get(f"{stack.gateway}/metrics", headers=monitoring_headers(), timeout=10).text
    families = text_string_to_metric_families(text)
    return sum(
        found.value
        for family in families
        for found in family.samples
        if found.name == sample and labels.items() <= found.labels.items()
    )


@pytest.mark.engine
@pytest.mark.django_db(transaction=True)
def test_the_platforms_metrics_show_a_ray_models_series_as_the_pools(dana, ray_stack, make_adapter):
    name = publish_fine_tuned_model(dana, _suffix("ray-counted"), make_adapter(seed=7))
    answered = {"endpoint": "chat/completions", "status": "200"}
    base_before = _platform_metric(ray_stack, "fineserve_inference_requests_total", model=BASE, **answered)
    loads_before = _platform_metric(ray_stack, "fineserve_adapter_loads_total", base_model=BASE, outcome="loaded")
    _ask(dana, BASE, max_tokens=2)
    _ask(dana, name, max_tokens=2)

    requests = "fineserve_inference_requests_total"
    assert _platform_metric(ray_stack, requests, model=BASE, **answered) == base_before + 1
    assert _platform_metric(ray_stack, requests, model=name, **answered) == 1  # as asked, not pinned
    assert _platform_metric(ray_stack, "fineserve_inference_request_seconds_count", model=name) == 1
    assert _platform_metric(ray_stack, "fineserve_adapter_loads_total", base_model=BASE, outcome="loaded") > loads_before
    assert _platform_metric(ray_stack, "fineserve_replica_healthy", model=BASE) == 1  # its one replica
    assert _platform_metric(ray_stack, "fineserve_replica_adapters_loaded", model=BASE) >= 1
    assert httpx.get(f"{ray_stack.gateway}/metrics").status_code == 401
    assert httpx.get(f"{ray_stack.serve_url}/metrics").status_code == 401  # the ingress: the internal token only


@pytest.mark.engine
@pytest.mark.django_db(transaction=True)
def test_ray_streams_the_same_answer_with_usage(dana, make_adapter):
    name = publish_fine_tuned_model(dana, _suffix("ray-stream"), make_adapter(seed=3))
    chunks = list(_ask(dana, name, stream=True, stream_options={"include_usage": True}))
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert len([chunk for chunk in chunks if chunk.choices]) > 3
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert text == _ask(dana, name).choices[0].message.content


@pytest.mark.engine
@pytest.mark.django_db(transaction=True)
def test_usage_on_ray_is_counted_at_the_gateway_as_the_engine_answered(dana, ray_stack):
    started = int(time.time())
    whole = _ask(dana, BASE)
    streamed = list(_ask(dana, BASE, stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage == whole.usage

    wait_until(lambda: usage_reported(ray_stack.gateway, dana.api_key, started, 2), 30, "the gateway's usage flush")
    result = usage_reported(ray_stack.gateway, dana.api_key, started, 2)
    assert (result["model"], result["input_tokens"], result["output_tokens"]) == (
        BASE,
        2 * whole.usage.prompt_tokens,
        2 * whole.usage.completion_tokens,
    )


@pytest.mark.engine
@pytest.mark.django_db(transaction=True)
def test_ray_follows_json_schemas_with_an_adapter(dana, make_adapter):
    name = publish_fine_tuned_model(dana, _suffix("ray-json"), make_adapter(seed=6))
    answer = _ask(dana, name, max_tokens=60, response_format=PLACE_FORMAT)
    assert set(json.loads(answer.choices[0].message.content)) == {"city", "country"}


@pytest.mark.engine
@pytest.mark.django_db(transaction=True)
def test_ray_calls_tools_with_an_adapter_whole_and_streamed(dana, make_adapter):
    name = publish_fine_tuned_model(dana, _suffix("ray-tools"), make_adapter(seed=6))
    client = dana.client.with_options(max_retries=12)  # a 503 with Retry-After while a cold model starts
    asked = {"model": name, "messages": QUESTION, "temperature": 0, "max_tokens": 60, "tools": [TWO_CITIES]}
    asked["tool_choice"] = "required"
    whole = client.chat.completions.create(**asked).choices[0].message.tool_calls
    streamed = assembled_tool_calls(client.chat.completions.create(**asked, stream=True))
    for calls in (whole, streamed):
        (call,) = calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    # greedy: the same call (a stream's arguments are the text as generated, a whole answer's re-serialized)
    assert json.loads(whole[0].function.arguments) == json.loads(streamed[0].function.arguments)


@pytest.mark.engine
@pytest.mark.django_db(transaction=True)
def test_on_ray_a_stream_that_began_on_r1_ends_on_r1_while_r2_is_published(dana, make_adapter):
    name = publish_fine_tuned_model(dana, _suffix("ray-revisions"), make_adapter(seed=20))
    first = _ask(dana, name).choices[0].message.content
    stream = _ask(dana, name, stream=True)
    chunks = [next(stream)]  # streaming on r1
    _publish_revision(name, make_adapter(seed=21), 2)
    second = _ask(dana, name)  # answered while the stream is still open
    chunks += list(stream)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == first
    assert {chunk.model for chunk in chunks} == {f"{name}@r1"}
    assert second.model == f"{name}@r2" and second.choices[0].message.content != first
    assert _ask(dana, f"{name}@r1").choices[0].message.content == first


@pytest.mark.engine
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "case",
    [
        mix_cases.a_half_and_half_mix_answers_as_peft,
        mix_cases.a_wide_mix_and_a_scale_alone_answer_as_peft,
        mix_cases.mixed_scaled_and_plain_requests_in_one_batch_get_their_own_answers,
    ],
    ids=lambda case: case.__name__,
)
def test_ray_mixes_adapters_in_the_kernel_as_the_pool_does(dana, make_adapter, case):
    """The pool's mix cases (tests/mix_cases.py), on a Ray replica."""
    case(dana, make_adapter)


@pytest.mark.engine
@pytest.mark.django_db(transaction=True)
def test_ray_refuses_missing_adapters_and_callers_without_the_internal_token(dana, ray_stack, make_adapter):
    name = publish_fine_tuned_model(dana, _suffix("ray-refusals"), make_adapter(seed=4))
    adapter_store().delete(name)
    with pytest.raises(openai.NotFoundError) as missing:
        _ask(dana, name)
    assert missing.value.body["code"] == "adapter_not_found"
    anyone = httpx.post(f"{ray_stack.serve_url}/v1/chat/completions", json={"model": BASE, "messages": QUESTION})
    assert anyone.status_code == 401 and anyone.json()["error"]["code"] == "missing_internal_token"


@pytest.mark.engine
@pytest.mark.django_db(transaction=True)
def test_the_publish_gate_scores_a_ray_backed_model_on_ray_serve_and_counts_its_answers(dana, ray_stack, make_adapter, settings):
    """The gate once called the embedded pool whatever the model's backend: it answers through Ray now."""
    from usage.models import CompletionUsage
    from workers import evaluation

    settings.MODEL_CATALOG = load_catalog(RAY_CATALOG, ROOT / "data", settings.CONFIG.dynamic_lora_path)
    settings.RAY_SERVE_URL, settings.INFERENCE_POOL_URL = ray_stack.serve_url, "http://127.0.0.1:9"  # no pool there
    name = publish_fine_tuned_model(dana, _suffix("ray-gated"), make_adapter(seed=9))
    examples = [json.loads(line)["messages"] for line in capitals().decode().splitlines()]
    gate = {"graders": [{"type": "regex", "pattern": r"\w"}], "threshold": 0.0}  # any word
    scores = evaluation.evaluate(dana.organization.pk, gate, examples, BASE, f"{name}@r1")
    # The base model answers each with words; the random adapter (seed 9) most (11 of 12 when measured).
    assert (scores.examples, scores.reference_score) == (12, 1.0) and scores.adapter_score >= 0.75
    assert scores.passed == (scores.adapter_score == 1.0)
    counted = Counter()
    for row in CompletionUsage.objects.filter(organization=dana.organization):  # a row a minute
        counted[row.model] += row.requests
    assert counted == {BASE: len(examples), f"{name}@r1": len(examples)}


@pytest.mark.engine
@pytest.mark.django_db(transaction=True)
def test_a_published_fine_tune_is_preloaded_on_its_ray_replica_before_its_first_request(dana, ray_stack, make_adapter, settings):
    """What the worker does once a job's model is published (``announce_ready``) loads it where Ray
    routes its requests, as the embedded pool does (the product test checks the pool)."""
    from finetuning.models import FineTuningJob
    from finetuning.publishing import announce_ready

    settings.MODEL_CATALOG = load_catalog(RAY_CATALOG, ROOT / "data", settings.CONFIG.dynamic_lora_path)
    settings.RAY_SERVE_URL, settings.INFERENCE_POOL_URL = ray_stack.serve_url, "http://127.0.0.1:9"  # no pool there
    _warm(dana)  # a preload starts no replica of a model scaled to zero
    name = publish_fine_tuned_model(dana, _suffix("ray-preloaded"), make_adapter(seed=12))
    job = FineTuningJob.objects.get(fine_tuned_model=name)
    assert f"{name}@r1" not in _held_on_ray(ray_stack)

    announce_ready(job, name)

    assert job.events.first().message.startswith("Ready on 1 replica(s)"), job.events.first().message
    assert f"{name}@r1" in _held_on_ray(ray_stack)
