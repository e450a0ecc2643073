"""Serverless behaviour of the embedded pool: a model scaled to zero holds no engine memory until a
request comes, that request wakes or starts a replica and waits for it (bounded: then a 503 with
Retry-After), another replica wakes or starts when the awake ones are busy, and a replica past the
minimum sleeps (``idle = "sleep"``: its process kept, its KV cache given back) or stops
(``idle = "stop"``) after its idle time. The pool's health and ``/v1/models`` say "cold", "asleep",
"starting", "waking", "ready" or "loaded".

The fast tests run the pool's real scheduling with stand-ins for vLLM (``sleep``, or
``tests.stand_in_replica``, which answers the pool at once): they decide when a replica is ready,
which an engine would take seconds to be. The engine test at the end starts, puts to sleep and
wakes a real vLLM replica through a pool of its own.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from core import api_errors
from core.catalog import Autoscaling, BaseModel, Catalog, EngineConfig, LoraConfig
from inference.metrics import Metrics
from inference.pool import COLD_START_RETRY_AFTER_S, Pool
from tests.inference_fixtures import BASE, internal_headers, pool_environment
from tests.processes import answers, free_port, running, wait_until


def _model(
    replicas: int = 1, min_replicas: int = 0, busy_at: int = 2, idle_s: int = 60, wait_s: float = 5.0, idle: str = "stop"
) -> BaseModel:
    return BaseModel(
        id=BASE, backend="embedded", weights=Path("unused"), prepare_from=None, replicas=replicas,
        lora=LoraConfig("unused", 2, 16), engine=EngineConfig(2048, "float32", 2, 1, ()),
        autoscaling=Autoscaling(min_replicas, busy_at, idle_s, wait_s, idle),
    )


def _pools_of_stand_ins(monkeypatch, command: Callable[[int], list[str]]) -> Iterator[Callable[[BaseModel], Pool]]:
    """Pools of one model whose replicas run ``command(port)`` instead of vLLM; stopped after the test."""
    monkeypatch.setattr("inference.replica.vllm_command", lambda model, port: command(port))
    monkeypatch.setattr("inference.replica.vllm_environment", lambda model, key: dict(os.environ))
    pools: list[Pool] = []

    def pool_of(model: BaseModel) -> Pool:
        pools.append(Pool(Catalog((model,)), free_port(), "token"))
        return pools[-1]

    yield pool_of
    for pool in pools:
        pool.stop()


@pytest.fixture
def stand_in_engine(monkeypatch):
    """Replicas that ``sleep``: the test says when they are ready."""
    yield from _pools_of_stand_ins(monkeypatch, lambda port: [sys.executable, "-c", "import time; time.sleep(600)"])


def _tick(pool: Pool, now: float | None = None) -> None:
    """The pool's once-a-second supervision, but for the health probes (the test plays the engine)."""
    now = time.monotonic() if now is None else now
    pool.autoscale(now)
    for replica in pool.replicas:
        replica.supervise(now)


def _state(pool: Pool) -> str:
    return pool.health()["models"][BASE]["state"]


def test_a_model_scaled_to_zero_runs_nothing_and_its_pool_is_serving(stand_in_engine):
    pool = stand_in_engine(_model(min_replicas=0))
    _tick(pool)
    assert [replica.process for replica in pool.replicas] == [None]
    assert _state(pool) == "cold" and pool.health()["serving"] is True  # by choice: nothing is wrong


def test_an_always_on_model_starts_at_once_and_is_not_serving_until_ready(stand_in_engine):
    pool = stand_in_engine(_model(min_replicas=1))
    _tick(pool)
    assert pool.replicas[0].process is not None
    assert _state(pool) == "starting" and pool.health()["serving"] is False


def test_a_request_for_a_cold_model_starts_one_replica_and_waits_until_it_is_ready(stand_in_engine):
    async def scenario(pool: Pool) -> list:
        waiting = [asyncio.create_task(pool.ready_or_start(BASE)) for _ in range(3)]
        await asyncio.sleep(0.3)
        assert not any(task.done() for task in waiting)
        assert _state(pool) == "starting"
        pool.replicas[0].mark_ready()  # what the health probe does once the engine answers
        return await asyncio.gather(*waiting)

    pool = stand_in_engine(_model(replicas=2, min_replicas=0))
    answered = asyncio.run(scenario(pool))
    assert answered == [[pool.replicas[0]]] * 3
    assert pool.replicas[1].process is None  # three waiting requests started one replica, not three


def test_a_cold_start_longer_than_the_wait_is_a_503_with_retry_after_and_the_replica_keeps_starting(stand_in_engine):
    pool = stand_in_engine(_model(wait_s=0.3))
    started = time.monotonic()
    with pytest.raises(api_errors.ApiError) as refused:
        asyncio.run(pool.ready_or_start(BASE))
    assert 0.3 <= time.monotonic() - started < 2
    assert (refused.value.status, refused.value.code) == (503, "model_starting")
    assert refused.value.headers()["Retry-After"] == str(COLD_START_RETRY_AFTER_S)
    assert pool.replicas[0].process.poll() is None and _state(pool) == "starting"


def test_a_replica_that_would_not_fit_the_free_memory_is_not_started_and_its_request_is_told_why(
    stand_in_engine, monkeypatch
):
    monkeypatch.setattr("core.memory_plan.available_bytes", lambda: 2**30)  # 1 GiB free
    pool = stand_in_engine(_model(wait_s=5))
    started = time.monotonic()
    with pytest.raises(api_errors.ApiError) as refused:
        asyncio.run(pool.ready_or_start(BASE))
    assert time.monotonic() - started < 1  # told at once, not after the cold-start wait
    assert (refused.value.status, refused.value.code) == (503, "model_does_not_fit")
    message = refused.value.message
    assert f"a replica of the catalog entry `{BASE}` needs 4.00 GiB" in message  # 1 GiB of KV cache + 3 of overhead
    assert "this machine has 1.00 GiB available" in message and "kv_cache_space_gib" in message
    replica = pool.replicas[0]
    assert replica.process is None and replica.status()["start_refused"] in message
    monkeypatch.setattr("core.memory_plan.available_bytes", lambda: 64 * 2**30)  # memory freed
    replica.next_start_at = 0
    _tick(pool)
    assert replica.process is not None and replica.start_refused is None


def test_a_model_restarting_after_a_crash_is_not_waited_for(stand_in_engine):
    pool = stand_in_engine(_model(min_replicas=1, wait_s=30))
    _tick(pool)  # started, not ready: as after a crash
    started = time.monotonic()
    assert asyncio.run(pool.ready_or_start(BASE)) == []  # the caller's 503 comes at once
    assert time.monotonic() - started < 0.5


def test_an_idle_replica_past_the_minimum_stops_after_the_downscale_delay_and_not_before(stand_in_engine):
    pool = stand_in_engine(_model(min_replicas=0, idle_s=60))
    replica = pool.replicas[0]
    asyncio.run(_ready_soon(pool))
    now = time.monotonic()
    _tick(pool, now + 30)
    assert replica.wanted and replica.process.poll() is None  # idle 30 s of 60
    replica.begin(BASE)
    _tick(pool, now + 120)
    assert replica.wanted  # a request in flight: never stopped under it
    replica.end(BASE)
    _tick(pool, time.monotonic() + 61)
    assert _state(pool) in ("stopping", "cold") and not replica.healthy
    wait_until(lambda: _tick(pool) or replica.process is None, 10, "the stand-in engine to stop")
    assert _state(pool) == "cold" and replica.restarts == 0  # stopped by choice, not a crash


def test_the_minimum_keeps_running_however_idle(stand_in_engine):
    pool = stand_in_engine(_model(min_replicas=1, idle_s=1))
    _tick(pool)
    pool.replicas[0].mark_ready()
    _tick(pool, time.monotonic() + 3600)
    assert pool.replicas[0].wanted and _state(pool) == "ready"


def test_another_replica_starts_when_every_running_one_is_busy(stand_in_engine):
    pool = stand_in_engine(_model(replicas=2, min_replicas=1, busy_at=2))
    _tick(pool)
    first, second = pool.replicas
    first.mark_ready()
    first.begin(BASE)
    _tick(pool)
    assert not second.wanted  # one request of two
    first.begin(BASE)
    _tick(pool)
    assert second.wanted and second.process is not None


def test_a_preload_of_a_new_adapter_for_a_cold_model_is_refused_and_starts_nothing(stand_in_engine):
    from inference.completions import CompletionsHandler

    class Published:
        """The adapter store's answer for a just-published adapter, as ``AdapterManager.pinned`` gives it."""

        async def pinned(self, base_id: str, name: str) -> tuple[str, str]:
            return f"{name}@r1", "r1"

    pool = stand_in_engine(_model(min_replicas=0))
    handler = CompletionsHandler(pool, pool.catalog, Published(), None, None)  # type: ignore[arg-type]
    with pytest.raises(api_errors.ApiError) as refused:
        asyncio.run(handler.preload(f"{BASE}:tuned"))
    assert (refused.value.status, refused.value.code) == (409, "model_cold")  # its first completion starts it
    assert pool.replicas[0].process is None


# --- asleep: the process kept, the engine's KV cache given back ----------------------------------


@pytest.fixture
def answering_stand_in(monkeypatch):
    """Replicas that are ``tests.stand_in_replica``: they answer the pool's probes, sleep and wake at once."""
    yield from _pools_of_stand_ins(monkeypatch, lambda port: [sys.executable, "-m", "tests.stand_in_replica", str(port)])


async def _supervised_until(pool: Pool, client: httpx.AsyncClient, state: str, now: float | None = None) -> None:
    """The pool's whole supervision (probes, sleep and wake too), tick after tick, until the model is in ``state``."""
    deadline = time.monotonic() + 20
    while _state(pool) != state:
        assert time.monotonic() < deadline, f"the model is {_state(pool)!r}, not {state!r}, after 20 s"
        pool.autoscale(time.monotonic() if now is None else now)
        for replica in pool.replicas:
            replica.supervise(time.monotonic())
        await asyncio.gather(*(replica.probe(client) for replica in pool.replicas))
        await asyncio.gather(*(replica.sleep_or_wake(client) for replica in pool.replicas))
        await asyncio.sleep(0.1)


def test_a_model_kept_asleep_starts_its_replica_then_puts_it_to_sleep_and_its_pool_is_serving(answering_stand_in):
    pool = answering_stand_in(_model(min_replicas=0, idle="sleep"))

    async def scenario() -> None:
        async with httpx.AsyncClient() as client:
            await _supervised_until(pool, client, "asleep")

    asyncio.run(scenario())
    replica = pool.replicas[0]
    assert replica.process.poll() is None and replica.asleep and not replica.healthy  # kept, not routed to
    assert pool.ready(BASE) == [] and pool.health()["serving"] is True  # by choice: nothing is wrong
    metrics = Metrics()
    metrics.watch_replicas(lambda: pool.replicas)
    scraped = metrics.render().decode()
    for family in ("fineserve_replica_healthy", "fineserve_replica_asleep"):  # an operator's alert stays quiet
        assert f'{family}{{model="{BASE}",replica="{replica.url}"}} 1.0' in scraped


def test_requests_for_an_asleep_model_wake_its_replica_and_it_sleeps_again_once_idle(answering_stand_in):
    pool = answering_stand_in(_model(min_replicas=0, idle="sleep", idle_s=60, wait_s=10))
    replica = pool.replicas[0]

    async def scenario() -> None:
        async with httpx.AsyncClient() as client:
            await _supervised_until(pool, client, "asleep")
            pool.client = client  # as supervise_forever sets it: a request wakes the replica itself
            answered = await asyncio.gather(*(pool.ready_or_start(BASE) for _ in range(3)))  # none lost
            assert answered == [[replica]] * 3
            assert _state(pool) == "ready" and not replica.asleep
            replica.begin(BASE)  # a request in flight: never put to sleep under it
            pool.autoscale(time.monotonic() + 120)
            await replica.sleep_or_wake(client)
            assert not replica.asleep
            replica.end(BASE)
            await _supervised_until(pool, client, "asleep", now=time.monotonic() + 61)

    asyncio.run(scenario())
    assert replica.process.poll() is None and replica.restarts == 0  # the same process throughout


def test_a_model_scaled_to_zero_keeps_one_replica_asleep_and_stops_the_others_when_idle(stand_in_engine):
    pool = stand_in_engine(_model(replicas=3, min_replicas=0, busy_at=1, idle_s=60, idle="sleep"))
    kept, second, third = pool.replicas
    _tick(pool)
    assert kept.process is not None and kept.sleep_wanted  # started, to fall asleep once ready
    assert (second.wanted, third.wanted) == (False, False)  # the others cold
    kept.mark_ready()
    kept.sleep_wanted = False  # as a request that found it starting wants it (Pool._wake)
    kept.begin(BASE)
    _tick(pool)
    assert second.wanted and not second.sleep_wanted and second.process is not None  # busy: another starts
    second.mark_ready()
    kept.end(BASE)
    _tick(pool, time.monotonic() + 61)  # both idle: one kept asleep, the other stopped
    assert sorted([kept.sleep_wanted and kept.wanted, second.sleep_wanted and second.wanted]) == [False, True]
    assert [replica.wanted for replica in (kept, second)].count(False) == 1


def test_an_asleep_replica_whose_kv_cache_would_not_fit_is_not_woken_and_its_request_is_told_why(
    answering_stand_in, monkeypatch
):
    pool = answering_stand_in(_model(min_replicas=0, idle="sleep", wait_s=5))

    async def scenario() -> api_errors.ApiError:
        async with httpx.AsyncClient() as client:
            await _supervised_until(pool, client, "asleep")
            pool.client = client
            monkeypatch.setattr("core.memory_plan.available_bytes", lambda: 2**20)  # 1 MiB free
            with pytest.raises(api_errors.ApiError) as refused:
                await pool.ready_or_start(BASE)
            return refused.value

    refused = asyncio.run(scenario())
    assert (refused.status, refused.code) == (503, "model_does_not_fit")
    assert f"an asleep replica of the catalog entry `{BASE}` needs 1.00 GiB for its KV cache to wake" in refused.message
    assert pool.replicas[0].asleep and pool.replicas[0].process.poll() is None  # still asleep, still kept


def test_a_ray_replica_of_a_model_scaled_to_zero_sleeps_once_idle_never_under_a_request_and_wakes_for_one():
    from inference.ray_serve.idle_engine import IdleEngine

    port = free_port()
    with running("stand-in-replica", [sys.executable, "-m", "tests.stand_in_replica", str(port)]):
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: answers(f"{url}/health"), 30, "the stand-in replica")

        async def scenario() -> None:
            async with httpx.AsyncClient() as client:
                idle = IdleEngine(_model(min_replicas=0, idle="sleep", idle_s=60), client, url)
                await idle.sleep_if_idle()  # idle since it started: asleep at the first look
                assert idle.asleep
                idle.begin()
                await idle.awake()
                assert not idle.asleep
                idle.last_active_at -= 3600
                await idle.sleep_if_idle()
                assert not idle.asleep  # a request under way
                idle.end()
                await idle.sleep_if_idle()
                assert not idle.asleep  # idle for less than downscale_delay_s
                idle.last_active_at -= 61
                await idle.sleep_if_idle()
                assert idle.asleep
                always_on = IdleEngine(_model(min_replicas=1, idle="sleep"), client, url)
                await always_on.sleep_if_idle()
                assert not always_on.asleep  # a model not scaled to zero never sleeps

        asyncio.run(scenario())


async def _ready_soon(pool: Pool) -> None:
    async def engine_answers():
        await asyncio.sleep(0.1)
        pool.replicas[0].mark_ready()

    await asyncio.gather(pool.ready_or_start(BASE), engine_answers())


# --- a real engine ------------------------------------------------------------------------------

SCALED_TO_ZERO = """
[models.autoscaling]
min_replicas = 0
downscale_delay_s = 5
cold_start_wait_s = 5
"""


def _resident_bytes(pid: int) -> int:
    """A replica's memory: its server's and its engine's (the server's children) resident bytes."""
    server = psutil.Process(pid)
    return sum(process.memory_info().rss for process in [server, *server.children(recursive=True)])


@pytest.mark.engine
def test_a_real_replica_scaled_to_zero_starts_for_a_request_then_sleeps_when_idle_and_wakes_to_answer_alike(
    tmp_path, machine_to_itself
):
    """The client's side of serverless: 503s with Retry-After while a stopped engine starts, then the
    answer; once idle, the engine asleep in the same process with its KV cache given back; then a
    request answered at once and alike. Prints the cold start and the wake, for docs/benchmarks.md."""
    catalog = tmp_path / "models.toml"  # the test catalog (written by pool_environment), scaled to zero
    catalog.write_text(Path(pool_environment()["MODEL_CATALOG"]).read_text() + SCALED_TO_ZERO)
    url = f"http://127.0.0.1:{free_port()}"
    environment = {"MODEL_CATALOG": str(catalog), "INFERENCE_POOL_URL": url, "FIRST_REPLICA_PORT": str(free_port())}
    client = httpx.Client(base_url=url, headers=internal_headers(), timeout=60)

    def model_state() -> str | None:
        try:
            return client.get("/health").json()["models"][BASE]["state"]
        except (httpx.HTTPError, ValueError):
            return None

    ask = {"model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}
    with running("pool-scaled-to-zero", [sys.executable, "-m", "inference"], environment) as process:
        wait_until(lambda: model_state() == "starting", 60, "the pool, its replica starting", process)
        requested, refusals = time.monotonic(), []
        while (answer := client.post("/v1/chat/completions", json=ask)).status_code == 503:
            refusals.append(answer)
            assert answer.json()["error"]["code"] == "model_starting"
            assert answer.headers["Retry-After"] == str(COLD_START_RETRY_AFTER_S)
            time.sleep(2)  # the official clients wait as Retry-After says; a test has less time
        cold_start_s = time.monotonic() - requested
        assert answer.status_code == 200, answer.text
        warm = answer.json()["choices"][0]["message"]["content"]
        assert warm and refusals, "a CPU engine does not start within the 5 s a request waits"
        assert model_state() == "ready"
        pid = client.get("/health").json()["replicas"][0]["pid"]
        awake_bytes = _resident_bytes(pid)  # the KV cache touched whole at start

        wait_until(lambda: model_state() == "asleep", 30, "the idle replica to fall asleep", process)
        asleep_bytes = _resident_bytes(pid)
        kv_cache_bytes = int(0.25 * 2**30)  # the test catalog's kv_cache_space_gib
        assert awake_bytes - asleep_bytes >= 0.8 * kv_cache_bytes, (awake_bytes, asleep_bytes)
        replica = client.get("/health").json()["replicas"][0]
        assert (replica["pid"], replica["asleep"], replica["restarts"]) == (pid, True, 0)  # the same process, kept

        requested = time.monotonic()
        answer = client.post("/v1/chat/completions", json=ask)
        wake_s = time.monotonic() - requested
        assert answer.status_code == 200, answer.text  # within the 5 s a request waits: no retry
        assert answer.json()["choices"][0]["message"]["content"] == warm
        assert model_state() == "ready" and client.get("/health").json()["replicas"][0]["pid"] == pid
        print(
            f"\nfrom zero replicas to the first answer (8 tokens): {cold_start_s:.1f} s started, {wake_s:.2f} s woken; "
            f"the replica's memory {awake_bytes / 2**30:.2f} GiB awake, {asleep_bytes / 2**30:.2f} GiB asleep"
        )


# --- what the gateway tells users ---------------------------------------------------------------


def test_a_models_serving_state_reads_the_pools_health_document():
    from base.serving_client import Serving
    from finetuning.registry import UsableModel

    def usable(name: str, suffix: str | None = None, revision: int | None = None) -> UsableModel:
        return UsableModel(name, BASE, suffix, "system", None, revision=revision)  # type: ignore[arg-type]

    tuned, other = usable(f"{BASE}:tuned", "tuned", 2), usable(f"{BASE}:other", "other", 1)
    health = {
        "models": {BASE: {"state": "ready"}},
        "replicas": [
            {"model": BASE, "healthy": True, "adapters": [f"{BASE}:tuned@r2"]},
            {"model": BASE, "healthy": True, "adapters": [f"{BASE}:tuned@r1"]},  # an older revision: not this one
            {"model": BASE, "healthy": False, "adapters": [f"{BASE}:other@r1"]},  # down: not counted
        ],
    }
    serving = Serving.from_health(health)
    assert serving.of(usable(BASE)) == {"state": "loaded", "replicas": 2}
    assert serving.of(tuned) == {"state": "loaded", "replicas": 1}
    assert serving.of(other) == {"state": "ready", "replicas": 0}
    for state in ("starting", "cold"):
        idle = Serving.from_health({"models": {BASE: {"state": state}}, "replicas": []})
        assert idle.of(usable(BASE)) == idle.of(tuned) == {"state": state, "replicas": 0}
