"""The pool's routing, adapter cache and error handling, against fake vLLM replicas (no engine).

The fake speaks vLLM's admin and completion endpoints through httpx.MockTransport, so these tests
check what the pool asks replicas to do, in milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from core.catalog import load_catalog
from core.env import ConfigError
from inference import adapter_slots, adapter_source
from inference.adapter_slots import AdapterSlots
from inference.internal_auth import ReplicaGuard
from inference.replica import CPU_BUILD, vllm_command, vllm_environment
from inference.router import HOT_ADAPTER_INFLIGHT, choose_replica, rendezvous_order
from tests.fake_pool import INTERNAL, TOKEN, PoolUnderTest, _base_model, _settle, _vllm_error
from tests.helpers import anyio_backend  # noqa: F401 (a fixture)
from tests.inference_fixtures import BASE
from tests.s3 import running_s3_server, s3_server


@pytest.fixture(autouse=True)
def no_unload_grace(monkeypatch):
    """Adapters are unloadable as soon as their last request ends (the grace has its own test)."""
    monkeypatch.setattr(adapter_slots, "UNLOAD_GRACE_S", 0.0)


# --- fakes -------------------------------------------------------------------------------------


@dataclass
class FakeReplica:
    """Just what the router reads."""

    url: str
    inflight: int = 0
    per_model: dict = field(default_factory=dict)
    held: set = field(default_factory=set)

    def inflight_for(self, model: str) -> int:
        return self.per_model.get(model, 0)

    def holds(self, adapter: str) -> bool:
        return adapter in self.held


# --- the router --------------------------------------------------------------------------------


def test_it_keeps_sending_an_adapter_to_the_same_replica_and_spreads_adapters_over_replicas():
    replicas = [FakeReplica(f"http://r{i}") for i in range(4)]
    adapters = [f"{BASE}:a{i}" for i in range(40)]
    first = {name: choose_replica(replicas, name, adapter=True).url for name in adapters}
    again = {name: choose_replica(list(reversed(replicas)), name, adapter=True).url for name in adapters}
    assert first == again
    assert len(set(first.values())) == 4  # 40 adapters do not all land on one replica


def test_it_moves_only_the_adapters_of_a_replica_that_leaves():
    replicas = [FakeReplica(f"http://r{i}") for i in range(4)]
    adapters = [f"{BASE}:a{i}" for i in range(40)]
    before = {name: choose_replica(replicas, name, adapter=True).url for name in adapters}
    after = {name: choose_replica(replicas[:3], name, adapter=True).url for name in adapters}
    moved = {name for name in adapters if before[name] != after[name]}
    assert moved == {name for name in adapters if before[name] == "http://r3"}


def test_it_prefers_a_replica_that_already_holds_the_adapter():
    name = f"{BASE}:support"
    replicas = [FakeReplica(f"http://r{i}") for i in range(3)]
    stable = rendezvous_order(name, replicas)
    stable[-1].held.add(name)
    stable[-1].inflight = 5  # busier than the others, but no load is needed there
    assert choose_replica(replicas, name, adapter=True) is stable[-1]


def test_it_spreads_a_hot_adapter_to_a_less_loaded_replica():
    name = f"{BASE}:hot"
    replicas = [FakeReplica(f"http://r{i}") for i in range(3)]
    holder = rendezvous_order(name, replicas)[0]
    holder.held.add(name)
    holder.inflight = holder.per_model[name] = HOT_ADAPTER_INFLIGHT
    spare = choose_replica(replicas, name, adapter=True)
    assert spare is not holder and spare is rendezvous_order(name, replicas)[1]
    spare.held.add(name)
    spare.inflight = spare.per_model[name] = 1
    assert choose_replica(replicas, name, adapter=True) is spare  # now held in two places


def test_it_sends_base_model_requests_to_the_least_loaded_replica():
    replicas = [
        FakeReplica("http://r0", inflight=3),
        FakeReplica("http://r1", inflight=1),
        FakeReplica("http://r2", inflight=2),
    ]
    assert choose_replica(replicas, BASE, adapter=False).url == "http://r1"
    assert choose_replica([], BASE, adapter=False) is None


def test_it_evicts_the_least_recently_used_idle_adapter_never_a_busy_one():
    slots = AdapterSlots(capacity=2)
    for name in ("a", "b", "c"):
        slots.add(name, None)
    slots.touch("a")  # least recently used first: b, c, a
    slots.started("b")  # the engine is answering with b
    assert slots.victims(count_loading=False) == ["c"]  # b is older, but busy
    slots.add("d", None)
    assert slots.victims(count_loading=False) == ["a"]
    assert list(slots.held) == ["b", "d"]
    slots.finished("b")
    slots.loading.add("e")  # room is made before a load: b is idle now and the oldest
    assert slots.victims() == ["b"] and list(slots.held) == ["d"]


# --- adapters on replicas ----------------------------------------------------------------------


@pytest.mark.anyio
async def test_it_loads_an_adapter_on_first_use_and_reuses_it(tmp_path):
    pool = PoolUnderTest(tmp_path, replicas=1)
    name = pool.publish("support")
    for _ in range(3):
        response = await pool.chat(name)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == f"{name}@r1"  # the answer names the revision that answered
    assert len(pool.vllm.loads(pool.served(name))) == 1


@pytest.mark.anyio
async def test_its_metrics_count_each_model_and_show_each_replica(tmp_path):
    pool = PoolUnderTest(tmp_path, replicas=2)
    name = pool.publish("counted")
    assert (await pool.chat(BASE)).status_code == 200 and (await pool.chat(name)).status_code == 200
    text = (await pool.http.get("/metrics")).text
    for model in (BASE, name):  # a fine-tune under the name it was asked by, not its pinned revision
        assert f'fineserve_inference_requests_total{{endpoint="chat/completions",model="{model}",status="200"}} 1.0' in text
    assert f'fineserve_adapter_loads_total{{base_model="{BASE}",outcome="loaded"}} 1.0' in text
    for url in ("http://replica-0", "http://replica-1"):
        assert f'fineserve_replica_healthy{{model="{BASE}",replica="{url}"}} 1.0' in text
        assert f'fineserve_replica_restarts_total{{model="{BASE}",replica="{url}"}} 0.0' in text


@pytest.mark.anyio
async def test_it_evicts_the_least_recently_used_adapter_past_the_replica_capacity(tmp_path):
    pool = PoolUnderTest(tmp_path, replicas=1, max_adapters=2)
    a, b, c = (pool.publish(suffix) for suffix in ("a", "b", "c"))
    for name in (a, b, a, c):  # b is now the least recently used
        assert (await pool.chat(name)).status_code == 200
    await _settle()
    assert [call[2] for call in pool.vllm.unloads()] == [pool.served(b)]
    assert set(pool.vllm.loaded["http://replica-0"]) == {pool.served(a), pool.served(c)}
    assert pool.metrics.adapter_evictions.labels(BASE, "lru")._value.get() == 1


@pytest.mark.anyio
async def test_it_stays_within_capacity_when_many_adapters_load_at_once(tmp_path):
    pool = PoolUnderTest(tmp_path, replicas=1, max_adapters=3)
    answer = pool.vllm.handler
    jitter = random.Random(7)

    async def slow_replica(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(jitter.random() * 0.01)  # loads and answers interleave
        return answer(request)

    pool.client._transport = httpx.MockTransport(slow_replica)
    names = [pool.publish(f"s{i}") for i in range(5)]
    for _ in range(10):
        responses = await asyncio.gather(*(pool.chat(name) for name in names * 2))
        assert all(response.status_code == 200 for response in responses)
        await _settle()  # loads that ran together overshoot; the replica is trimmed once they are idle
        assert len(pool.pool.replicas[0].adapters.held) <= 3
        assert len(pool.vllm.loaded["http://replica-0"]) <= 3


@pytest.mark.anyio
async def test_it_never_unloads_an_adapter_while_the_replica_answers_with_it_and_loads_a_new_revision_beside_it(
    tmp_path, monkeypatch
):
    # vLLM tells adapters apart by name inside a batch: unloading one while its requests run would
    # crash the engine. So eviction waits for them; a new revision is another name, loaded beside.
    monkeypatch.setattr(adapter_slots, "UNLOAD_GRACE_S", 0.05)
    pool = PoolUnderTest(tmp_path, replicas=1, max_adapters=1)
    answer, release = pool.vllm.handler, asyncio.Event()

    async def slow_for_x_r1(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions" and json.loads(request.content)["model"] == f"{x}@r1":
            await release.wait()
        return answer(request)

    pool.client._transport = httpx.MockTransport(slow_for_x_r1)
    x, y = pool.publish("x"), pool.publish("y")
    first_x = asyncio.create_task(pool.chat(x))
    await _settle()
    assert (await pool.chat(y)).status_code == 200  # loaded beside x: the replica is over capacity
    assert pool.vllm.unloads() == []
    pool.publish("x")  # r2 of x while its first request runs on r1
    second_x = await pool.chat(x)  # does not wait for r1's request
    assert second_x.status_code == 200 and second_x.json()["model"] == f"{x}@r2"
    assert not first_x.done() and f"{x}@r1" not in [call[2] for call in pool.vllm.unloads()]
    release.set()
    first = await first_x
    assert first.status_code == 200 and first.json()["model"] == f"{x}@r1"  # it ended on the revision it began on
    await asyncio.sleep(0.3)  # the grace after the last requests, then the trim
    assert set(pool.vllm.loaded["http://replica-0"]) == {f"{x}@r2"}  # back within capacity: the most recent stays


@pytest.mark.anyio
async def test_a_preload_loads_a_published_adapter_where_its_first_request_will_go(tmp_path):
    pool = PoolUnderTest(tmp_path, replicas=2)
    name = pool.publish("ready")
    response = await pool.http.post("/v1/adapters/preload", json={"model": name})
    assert response.json() == {"model": f"{name}@r1", "replicas": 1}
    holder = next(replica for replica in pool.pool.replicas if replica.holds(f"{name}@r1"))
    assert (await pool.chat(name)).json()["replica"] == holder.url
    assert len(pool.loads_of(name)) == 1  # the first request found it loaded
    missing = await pool.http.post("/v1/adapters/preload", json={"model": f"{BASE}:nothing"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "adapter_not_found"
    for body in ({"name": name}, [name], {"model": BASE}):
        assert (await pool.http.post("/v1/adapters/preload", json=body)).status_code in (400, 404), body


@pytest.mark.anyio
async def test_it_answers_an_adapter_published_after_it_was_asked_for(tmp_path):
    pool = PoolUnderTest(tmp_path, replicas=1)
    name = f"{BASE}:late"
    missing = await pool.chat(name)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "adapter_not_found"
    pool.publish("late")
    assert (await pool.chat(name)).status_code == 200  # nothing remembered that it was missing


@pytest.mark.anyio
async def test_it_serves_a_republished_adapter_as_its_new_revision_and_unloads_a_deleted_one(tmp_path):
    pool = PoolUnderTest(tmp_path, replicas=1)
    name = pool.publish("support")
    await pool.chat(name)
    pool.publish("support")
    assert (await pool.chat(name)).json()["model"] == f"{name}@r2"
    assert set(pool.vllm.loaded["http://replica-0"]) == {f"{name}@r1", f"{name}@r2"}
    assert (await pool.chat(f"{name}@r1")).json()["model"] == f"{name}@r1"  # pinned: still served
    pool.store.point(name, 1)  # a rollback: the next request answers with r1
    assert (await pool.chat(name)).json()["model"] == f"{name}@r1"
    pool.store.delete(name)
    response = await pool.chat(name)
    assert response.status_code == 404 and response.json()["error"]["code"] == "adapter_not_found"
    await _settle()  # unloading a deleted adapter happens in the background, once it is idle
    assert pool.vllm.loaded["http://replica-0"] == {}


@pytest.mark.anyio
async def test_it_refuses_an_adapter_whose_rank_exceeds_max_lora_rank(tmp_path):
    pool = PoolUnderTest(tmp_path, replicas=1)
    response = await pool.chat(pool.publish("wide", rank=32))
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "adapter_rank_too_large"
    assert "rank 32" in error["message"] and "max_lora_rank 16" in error["message"]
    assert pool.vllm.loads() == []


@pytest.mark.anyio
async def test_it_refuses_a_broken_adapter_folder_and_keeps_serving_others(tmp_path):
    pool = PoolUnderTest(tmp_path, replicas=1)
    response = await pool.chat(pool.publish("broken", config='{"r": 8,'))
    error = response.json()["error"]
    assert response.status_code == 500 and error["code"] == "adapter_invalid" and "not valid JSON" in error["message"]
    assert (await pool.chat(pool.publish("fine"))).status_code == 200


@pytest.mark.anyio
async def test_it_reloads_an_adapter_the_replica_lost(tmp_path):
    pool = PoolUnderTest(tmp_path, replicas=1)
    name = pool.publish("support")
    await pool.chat(name)
    pool.vllm.loaded["http://replica-0"].clear()  # as after a restart we did not notice
    assert (await pool.chat(name)).status_code == 200
    assert len(pool.loads_of(name)) == 2


@pytest.mark.anyio
async def test_it_routes_around_a_replica_that_does_not_answer(tmp_path):
    pool = PoolUnderTest(tmp_path, replicas=2)
    name = pool.publish("support")
    favourite = rendezvous_order(name, pool.pool.replicas)[0]
    pool.vllm.down.add(favourite.url)
    response = await pool.chat(name)
    assert response.status_code == 200 and response.json()["replica"] != favourite.url
    assert not favourite.healthy  # out of routing until its health check passes again
    base = await pool.chat(BASE)
    assert base.status_code == 200 and base.json()["replica"] != favourite.url


@pytest.mark.anyio
async def test_it_never_sends_a_request_that_reached_a_failing_replica_to_another(tmp_path):
    pool = PoolUnderTest(tmp_path, replicas=2)
    name = pool.publish("support")
    favourite = rendezvous_order(name, pool.pool.replicas)[0]
    pool.vllm.dies_mid_request.add(favourite.url)
    response = await pool.chat(name)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "replica_unavailable"
    completions = [call for call in pool.vllm.calls if call[1] == "/v1/chat/completions"]
    assert completions == [(favourite.url, "/v1/chat/completions", pool.served(name))]  # once, on one replica
    assert not favourite.healthy
    assert (await pool.chat(name)).status_code == 200  # the next request goes elsewhere


@pytest.mark.anyio
async def test_it_takes_a_replica_whose_engine_died_out_of_routing(tmp_path):
    pool = PoolUnderTest(tmp_path, replicas=2)
    dead = rendezvous_order(BASE, pool.pool.replicas)[0]
    answer = pool.vllm.handler

    def engine_died_on_one(request: httpx.Request) -> httpx.Response:
        if str(request.url).startswith(dead.url) and request.url.path.endswith("completions"):
            return httpx.Response(500, json=_vllm_error("EngineCore encountered an issue. See stack trace", 500))
        return answer(request)

    pool.client._transport = httpx.MockTransport(engine_died_on_one)
    response = await pool.chat(BASE)
    assert response.status_code == 200 and response.json()["replica"] != dead.url
    assert not dead.healthy


@pytest.mark.anyio
async def test_it_answers_503_when_no_replica_is_ready(tmp_path):
    pool = PoolUnderTest(tmp_path, replicas=2)
    pool.vllm.down.update(replica.url for replica in pool.pool.replicas)
    response = await pool.chat(BASE)
    assert response.status_code == 503 and response.headers["retry-after"] == "5"
    assert response.json()["error"]["code"] == "no_replica_available"
    response = await pool.chat(BASE)  # now known to be down: no attempt at all
    assert response.status_code == 503


@pytest.mark.anyio
async def test_it_answers_404_for_a_model_outside_the_catalog(tmp_path):
    pool = PoolUnderTest(tmp_path, replicas=1)
    response = await pool.chat("gpt-4o")
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    response = await pool.http.post("/v1/chat/completions", content=b"[1, 2]")
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.anyio
async def test_it_counts_requests_adapter_loads_and_replica_health_in_metrics(tmp_path):
    pool = PoolUnderTest(tmp_path, replicas=1)
    name = pool.publish("support")
    await pool.chat(name)
    text = (await pool.http.get("/metrics")).text
    assert f'fineserve_inference_requests_total{{endpoint="chat/completions",model="{name}",status="200"}} 1.0' in text
    assert f'fineserve_adapter_loads_total{{base_model="{BASE}",outcome="loaded"}} 1.0' in text
    assert "fineserve_adapter_load_seconds_count" in text
    assert f'fineserve_replica_healthy{{model="{BASE}",replica="http://replica-0"}} 1.0' in text


# --- closed to everyone but the platform ---------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/health"), ("GET", "/metrics"),
])
async def test_it_refuses_a_request_without_the_internal_token(tmp_path, method, path):
    pool = PoolUnderTest(tmp_path, replicas=1)
    name = pool.publish("support")
    body = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
    a_users_key = {"Authorization": "Bearer sk-a-users-api-key"}
    for headers, code in (({}, "missing_internal_token"), (a_users_key, "invalid_internal_token")):
        transport = httpx.ASGITransport(app=pool.app)
        outsider = httpx.AsyncClient(transport=transport, base_url="http://pool", headers=headers)
        response = await outsider.request(method, path, json=body if method == "POST" else None)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == code and response.json()["error"]["type"] == "authentication_error"
        assert name not in response.text and BASE not in response.text
    assert pool.vllm.calls == []  # nothing reached a replica: no adapter loaded, no completion run
    assert (await pool.http.request(method, path, json=body if method == "POST" else None)).status_code == 200


@pytest.mark.anyio
async def test_it_keeps_a_replica_that_refuses_the_internal_token_out_of_routing(tmp_path):
    pool = PoolUnderTest(tmp_path, replicas=2)
    misconfigured = pool.pool.replicas[1]
    pool.vllm.api_keys[misconfigured.url] = "a remote vLLM started with another --api-key"
    for replica in pool.pool.replicas:
        replica.healthy = False
    await pool.pool.supervise_once(pool.client)
    await pool.pool.supervise_once(pool.client)
    assert [replica.healthy for replica in pool.pool.replicas] == [True, False]
    for suffix in ("a", "b", "c", "d"):
        response = await pool.chat(pool.publish(suffix))
        assert response.status_code == 200 and response.json()["replica"] == pool.pool.replicas[0].url


def test_it_starts_replicas_that_require_the_token_without_showing_it_on_their_command_line():
    model = _base_model("unused")
    command = vllm_command(model, 8200)
    assert TOKEN not in " ".join(command)  # ps shows every user of the machine each command line
    assert vllm_environment(model, TOKEN)["VLLM_API_KEY"] == TOKEN  # vLLM's --api-key reads it too
    assert command[command.index("--middleware") + 1] == "inference.internal_auth.ReplicaGuard"
    assert command[command.index("--host") + 1] == "127.0.0.1"
    with pytest.raises(ValueError, match="without an API key"):
        vllm_environment(model, "")


def test_a_cpu_replicas_kv_cache_is_the_catalogs_size_to_the_byte_fractions_of_a_gib_too(tmp_path):
    catalog = tmp_path / "models.toml"
    catalog.write_text(f'[[models]]\nid = "{BASE}"\nweights = "w"\n[models.engine]\nkv_cache_space_gib = 0.25\n')
    model = load_catalog(catalog, tmp_path, str(tmp_path)).models[0]
    command = vllm_command(model, 8200)
    if CPU_BUILD:
        assert command[command.index("--kv-cache-memory-bytes") + 1] == str(2**28)
    else:  # a GPU engine sizes its cache from its own memory
        assert "--kv-cache-memory-bytes" not in command
    catalog.write_text(catalog.read_text().replace("0.25", "0"))
    with pytest.raises(ConfigError, match="kv_cache_space_gib must be a number above 0"):
        load_catalog(catalog, tmp_path, str(tmp_path))


def test_a_replica_inherits_what_vllm_needs_and_none_of_the_platforms_secrets(monkeypatch):
    secrets = {
        "SECRET_KEY": "s" * 50, "DATABASE_URL": "postgres://app:pw@db/app", "REDIS_URL": "redis://:pw@cache/0",
        "AWS_SECRET_ACCESS_KEY": "aws", "AWS_ACCESS_KEY_ID": "id", "MONITORING_TOKEN": "m", "INTERNAL_TOKEN": "i",
    }
    needed = {
        "PATH": "/usr/bin", "HOME": "/home/app", "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "INFO", "OMP_NUM_THREADS": "2",
        "LORA_KERNELS": "stock", "DATA_DIR": "/srv/fineserve",
    }
    for name, value in {**secrets, **needed}.items():
        monkeypatch.setenv(name, value)
    environment = vllm_environment(_base_model("unused"), TOKEN)
    assert set(secrets).isdisjoint(environment)
    assert {name: environment.get(name) for name in needed} == needed and environment["VLLM_API_KEY"] == TOKEN


@pytest.mark.anyio
async def test_it_guards_every_route_of_a_replica_not_only_vllms_v1(monkeypatch):
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def answer(request):
        return PlainTextResponse("done")

    # vLLM's --api-key leaves these open: SageMaker's LoRA routes, /invocations, /metrics, /health.
    paths = ["/adapters", "/adapters/someone-elses", "/invocations", "/metrics", "/health", "/v1/models"]
    app = Starlette(routes=[Route(path, answer, methods=["GET", "POST", "DELETE"]) for path in paths])
    monkeypatch.setenv("VLLM_API_KEY", TOKEN)
    guarded = httpx.AsyncClient(transport=httpx.ASGITransport(app=ReplicaGuard(app)), base_url="http://replica")
    for path in paths:
        assert (await guarded.post(path)).status_code == 401
        assert (await guarded.delete(path, headers={"Authorization": "Bearer guess"})).status_code == 401
        assert (await guarded.post(path, headers=INTERNAL)).text == "done"
    monkeypatch.delenv("VLLM_API_KEY")
    with pytest.raises(ValueError, match="no internal token"):
        ReplicaGuard(app)  # a replica started without a key does not start at all


# --- keeping itself alive ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_it_keeps_what_a_busy_replica_holds_when_it_misses_two_probes(tmp_path):
    pool = PoolUnderTest(tmp_path, replicas=1)
    name = pool.publish("support")
    await pool.chat(name)
    replica = pool.pool.replicas[0]
    pool.vllm.too_busy_to_probe.add(replica.url)
    for _ in range(2):
        await pool.pool.supervise_once(pool.client)
    assert not replica.healthy  # out of routing while it does not answer...
    pool.vllm.too_busy_to_probe.clear()
    await pool.pool.supervise_once(pool.client)
    assert replica.healthy and replica.holds(pool.served(name))  # ...but what it holds was never forgotten
    assert (await pool.chat(name)).status_code == 200
    assert len(pool.loads_of(name)) == 1 and pool.vllm.unloads() == []  # no unload/reload under load


@pytest.mark.anyio
async def test_it_reads_back_the_adapters_a_replica_already_holds(tmp_path):
    first = PoolUnderTest(tmp_path, replicas=1)
    name = first.publish("support")
    await first.chat(name)
    # A new pool process in front of the same (remote) replica: it knows nothing yet.
    second = PoolUnderTest(tmp_path, replicas=1)
    second.vllm, second.client._transport = first.vllm, first.client._transport
    second.pool.replicas[0].healthy = False
    await second.pool.supervise_once(second.client)
    assert second.pool.replicas[0].holds(first.served(name))
    assert (await second.chat(name)).status_code == 200
    assert len(first.loads_of(name)) == 1 and first.vllm.unloads() == []


@pytest.mark.anyio
async def test_it_logs_an_error_in_a_supervision_round_and_goes_on(tmp_path, monkeypatch, caplog):
    from inference import pool as pool_module

    monkeypatch.setattr(pool_module, "SUPERVISE_INTERVAL_S", 0.01)
    pool = PoolUnderTest(tmp_path, replicas=1)
    replica = pool.pool.replicas[0]
    replica.healthy = False
    rounds = {"n": 0}

    def supervise_badly(now: float) -> None:
        rounds["n"] += 1
        if rounds["n"] == 1:
            raise RuntimeError("injected")

    monkeypatch.setattr(replica, "supervise", supervise_badly)
    supervisor = asyncio.create_task(pool.pool.supervise_forever(pool.client))
    for _ in range(200):
        await asyncio.sleep(0.01)
        if replica.healthy:
            break
    supervisor.cancel()
    assert rounds["n"] >= 2 and replica.healthy  # later rounds ran and probed it back in
    assert "supervising the replicas failed" in caplog.text and "injected" in caplog.text


@pytest.mark.anyio
async def test_it_unloads_a_deleted_adapter_from_every_replica_without_waiting_for_a_request(tmp_path):
    pool = PoolUnderTest(tmp_path, replicas=2)
    name = pool.publish("support")
    await pool.chat(name)
    served = pool.served(name)
    holder = next(replica for replica in pool.pool.replicas if replica.holds(served))
    holder.adapters.started(served)  # a request still streaming with it
    pool.store.delete(name)
    await pool.adapters.retire_deleted()
    await _settle()
    assert served in pool.vllm.loaded[holder.url]  # the stream finishes first
    holder.adapters.finished(served)
    await _settle()
    assert not holder.holds(served) and served not in pool.vllm.loaded[holder.url]


# --- S3 ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3():
    with s3_server("adapters") as settings:
        yield settings


@pytest.mark.anyio
async def test_it_syncs_an_s3_adapter_once_for_concurrent_requests_on_every_replica(tmp_path, s3):
    pool = PoolUnderTest(tmp_path, replicas=2, dynamic=f"s3://adapters/{tmp_path.name}", s3=s3)
    name = pool.publish("support")
    responses = await asyncio.gather(*(pool.chat(name) for _ in range(8)))
    assert all(response.status_code == 200 for response in responses)
    assert pool.metrics.adapter_downloads.labels(BASE)._value.get() == 1
    loaded_from = {path for held in pool.vllm.loaded.values() for path in held.values()}
    assert len(loaded_from) == 1
    folder = Path(loaded_from.pop())
    assert folder.is_relative_to(tmp_path / "cache")
    assert (folder / "adapter_model.safetensors").read_bytes() == b"weights support-0"


@pytest.mark.anyio
async def test_it_refuses_an_s3_adapter_whose_bytes_do_not_match_their_checksum(tmp_path, s3):
    pool = PoolUnderTest(tmp_path, replicas=1, dynamic=f"s3://adapters/{tmp_path.name}", s3=s3)
    name = pool.publish("tampered")
    key = pool.store.key(f"{name}@r1", "adapter_model.safetensors")  # the revision the pool reads
    head = pool.store.client.head_object(Bucket="adapters", Key=key)
    pool.store.client.put_object(Bucket="adapters", Key=key, Body=b"evil", Metadata=head["Metadata"])
    response = await pool.chat(name)
    assert response.status_code == 500 and "checksum" in response.json()["error"]["message"]
    assert pool.vllm.loads() == []


@pytest.mark.anyio
async def test_it_serves_loaded_s3_adapters_while_s3_is_down_and_asks_for_a_retry_of_a_cold_one(tmp_path, monkeypatch):
    monkeypatch.setattr(adapter_source, "REMOTE_VERSION_TTL_S", 0.0)  # every request asks S3
    monkeypatch.setattr(adapter_source, "KNOWN_VERSION_WAIT_S", 10.0)  # and waits for its answer, however busy CI is
    with running_s3_server("outage") as s3:
        pool = PoolUnderTest(tmp_path, replicas=1, dynamic=f"s3://outage/{tmp_path.name}", s3=s3.settings)
        warm, cold = pool.publish("warm"), pool.publish("cold")
        assert (await pool.chat(warm)).status_code == 200
        s3.stop()
        for _ in range(3):
            assert (await pool.chat(warm)).status_code == 200
        response = await pool.chat(cold)
        assert response.status_code == 503 and response.headers["retry-after"] == "5"
        assert response.json()["error"]["code"] == "adapter_store_unavailable"
        s3.start()
        assert (await pool.chat(cold)).status_code == 200
        pool.publish("warm")  # checked again now that S3 answers: the new revision loads
        assert (await pool.chat(warm)).json()["model"] == f"{warm}@r2"
        assert len(pool.loads_of(warm)) == 2


@pytest.mark.anyio
async def test_it_removes_the_cached_copy_of_a_deleted_s3_adapter(tmp_path, s3, monkeypatch):
    pool = PoolUnderTest(tmp_path, replicas=1, dynamic=f"s3://adapters/{tmp_path.name}", s3=s3)
    name = pool.publish("short-lived")
    assert (await pool.chat(name)).status_code == 200
    assert list((tmp_path / "cache").rglob("adapter_model.safetensors"))
    pool.store.delete(name)
    monkeypatch.setattr(adapter_source, "REMOTE_VERSION_TTL_S", 0.0)  # the next look at S3 sees it gone
    await pool.adapters.retire_deleted()
    await _settle()
    assert not pool.pool.replicas[0].holds(name)
    assert not list((tmp_path / "cache").rglob("adapter_model.safetensors"))


@pytest.mark.anyio
async def test_it_downloads_an_s3_adapter_while_its_request_waits_for_a_replica_to_start(tmp_path, s3, monkeypatch):
    pool = PoolUnderTest(tmp_path, replicas=1, dynamic=f"s3://adapters/{tmp_path.name}", s3=s3)
    name = pool.publish("early")
    replica = pool.pool.replicas[0]
    replica.healthy = False  # cold: no replica runs
    downloads = pool.metrics.adapter_downloads.labels(BASE)
    downloaded_during_start: list[float] = []

    async def start_replica(model_id: str) -> list:
        for _ in range(200):  # a replica's start takes seconds; the download, without prefetch, never starts
            if downloads._value.get() == 1:
                break
            await asyncio.sleep(0.05)
        downloaded_during_start.append(downloads._value.get())
        replica.healthy = True
        return [replica]

    monkeypatch.setattr(pool.pool, "ready_or_start", start_replica)
    response = await pool.chat(name)
    assert response.status_code == 200 and downloaded_during_start == [1]
    assert downloads._value.get() == 1  # the request's own load used the copy fetched meanwhile


def _weights_loaded(pool: PoolUnderTest, served: str) -> bytes:
    """The weights file of the folder the replica loaded ``served`` from."""
    folders = [held[served] for held in pool.vllm.loaded.values() if served in held]
    assert len(folders) == 1, folders
    return (Path(folders[0]) / "adapter_model.safetensors").read_bytes()


def _cached_weights(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "cache").rglob("adapter_model.safetensors"))


@pytest.mark.anyio
async def test_an_evicted_then_deleted_s3_adapters_copy_never_answers_for_a_new_model_under_its_name(
    tmp_path, s3, monkeypatch
):
    monkeypatch.setattr(adapter_source, "REMOTE_VERSION_TTL_S", 0.0)  # each look at S3 sees what it holds now
    pool = PoolUnderTest(tmp_path, replicas=1, max_adapters=1, dynamic=f"s3://adapters/{tmp_path.name}", s3=s3)
    name = pool.publish("x")  # alice's organization's model
    alices = (tmp_path / "out" / "x-0" / "adapter_model.safetensors").read_bytes()
    assert (await pool.chat(name)).status_code == 200
    assert (await pool.chat(pool.publish("y"))).status_code == 200  # x is evicted
    await _settle()
    pool.store.delete(name)  # alice deletes it
    await pool.adapters.retire_deleted()
    await _settle()
    pool.publish("x")  # charlie's organization publishes other weights under the same name: r1 again
    charlies = (tmp_path / "out" / "x-2" / "adapter_model.safetensors").read_bytes()
    answer = await pool.chat(name)
    assert answer.status_code == 200 and answer.json()["model"] == f"{name}@r1"
    assert _weights_loaded(pool, f"{name}@r1") == charlies != alices


@pytest.mark.anyio
async def test_a_held_adapter_deleted_and_published_again_before_the_next_check_is_loaded_afresh(
    tmp_path, s3, monkeypatch
):
    monkeypatch.setattr(adapter_source, "REMOTE_VERSION_TTL_S", 0.0)
    pool = PoolUnderTest(tmp_path, replicas=1, dynamic=f"s3://adapters/{tmp_path.name}", s3=s3)
    name = pool.publish("x")
    assert (await pool.chat(name)).status_code == 200
    first_path = pool.vllm.loaded["http://replica-0"][f"{name}@r1"]
    pool.store.delete(name)  # no request and no check in between: the replica still holds it
    pool.publish("x")
    charlies = (tmp_path / "out" / "x-1" / "adapter_model.safetensors").read_bytes()
    assert (await pool.chat(name)).status_code == 200
    assert _weights_loaded(pool, f"{name}@r1") == charlies
    # vLLM got it as a new adapter (unloaded, then loaded from another folder: a new int id, and a
    # prefix-cache key of its own), not the old weights under the old name
    assert [call[2] for call in pool.vllm.unloads()] == [f"{name}@r1"]
    assert pool.vllm.loaded["http://replica-0"][f"{name}@r1"] != first_path
    await _settle()
    loaded_from = Path(pool.vllm.loaded["http://replica-0"][f"{name}@r1"])
    assert [path.parent for path in _cached_weights(tmp_path)] == [loaded_from]  # alice's copy went


@pytest.mark.anyio
async def test_a_held_adapter_deleted_and_published_again_on_a_local_path_is_reloaded_not_kept(tmp_path):
    # The new revision's folder has the deleted one's path: only its publish id tells them apart,
    # and the engine holds the old weights in memory until it is told to load again.
    pool = PoolUnderTest(tmp_path, replicas=1)
    name = pool.publish("x")
    assert (await pool.chat(name)).status_code == 200
    first_path = pool.vllm.loaded["http://replica-0"][f"{name}@r1"]
    pool.store.delete(name)
    pool.publish("x")
    assert (await pool.chat(name)).status_code == 200
    assert len(pool.vllm.loads(f"{name}@r1")) == 2 and [call[2] for call in pool.vllm.unloads()] == [f"{name}@r1"]
    # from a path of its own: vLLM keys its prefix cache by an adapter's name and path, and blocks
    # computed with the deleted weights must not answer for the new ones
    second_path = pool.vllm.loaded["http://replica-0"][f"{name}@r1"]
    assert second_path != first_path
    assert (Path(second_path) / "adapter_model.safetensors").read_bytes() == b"weights x-1"
    await pool.adapters.retire_deleted()
    pool.store.delete(name)
    await pool.adapters.retire_deleted()
    await _settle()
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*@*"))  # nothing left behind


@pytest.mark.anyio
async def test_an_evicted_local_adapter_leaves_the_cache_and_stays_in_the_store(tmp_path):
    pool = PoolUnderTest(tmp_path, replicas=1, max_adapters=1)
    a, b = pool.publish("a"), pool.publish("b")
    for name in (a, b, a):  # b's load evicts a, a's evicts b
        assert (await pool.chat(name)).status_code == 200
        await _settle()
    links = [path for path in (tmp_path / "cache").rglob("*@*") if path.is_symlink()]
    assert [link.name.partition("@")[0] for link in links] == ["SmolLM2-135M-Instruct:a"]  # b's link went
    assert all((pool.store.path(name) / "adapter_model.safetensors").is_file() for name in (a, b))  # not b's files


@pytest.mark.anyio
async def test_the_s3_cache_holds_only_the_adapters_replicas_hold_not_evicted_or_deleted_ones(
    tmp_path, s3, monkeypatch
):
    monkeypatch.setattr(adapter_source, "REMOTE_VERSION_TTL_S", 0.0)
    pool = PoolUnderTest(tmp_path, replicas=2, max_adapters=1, dynamic=f"s3://adapters/{tmp_path.name}", s3=s3)
    names = [pool.publish(f"s{i}") for i in range(6)]
    for name in names:  # each evicts the one before on its replica
        assert (await pool.chat(name)).status_code == 200
        await _settle()
    held = {Path(folder) / "adapter_model.safetensors" for loaded in pool.vllm.loaded.values() for folder in loaded.values()}  # noqa: E501
    assert len(held) <= 2 and set(_cached_weights(tmp_path)) == held
    for name in names:
        pool.store.delete(name)
    await pool.adapters.retire_deleted()
    await _settle()
    assert _cached_weights(tmp_path) == [] and all(loaded == {} for loaded in pool.vllm.loaded.values())


@pytest.mark.anyio
async def test_a_cached_copy_no_replica_holds_goes_once_nobody_asked_for_it_for_a_while(tmp_path, s3, monkeypatch):
    pool = PoolUnderTest(tmp_path, replicas=1, dynamic=f"s3://adapters/{tmp_path.name}", s3=s3)
    refused = await pool.chat(pool.publish("wide", rank=32))  # downloaded, then refused: no replica holds it
    assert refused.status_code == 400 and len(_cached_weights(tmp_path)) == 1
    await pool.adapters.retire_deleted()
    assert len(_cached_weights(tmp_path)) == 1  # asked for a moment ago: kept
    monkeypatch.setattr(adapter_source, "UNUSED_COPY_TTL_S", 0.0)
    assert (await pool.chat(pool.publish("held"))).status_code == 200
    await pool.adapters.retire_deleted()
    held = Path(pool.vllm.loaded["http://replica-0"][pool.served(f"{BASE}:held")])
    assert [path.parent for path in _cached_weights(tmp_path)] == [held]  # the orphan went, the held copy stays
