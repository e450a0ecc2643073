"""Whose turn it is on a replica. Background work (a batch's lines, an evaluation's answers) yields to
live requests, on the embedded pool and on a Ray Serve replica alike: beside live requests a replica runs
one background request at a time, alone as many as come. On Ray, an organization over its share of the
batch slots waits for its own requests while another's are answered (the pool's case:
tests/test_adapter_fair_use.py). Against a vLLM stand-in that holds each answer until the test lets it
go, so what runs at once is seen; on Ray, the replica's own answer path (``VllmReplica.answer``, which
the ingress calls with the gateway's marks) is driven without Ray or an engine.
"""

from __future__ import annotations

import asyncio
from collections import Counter
import contextvars
import json
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import httpx
import pytest

from core.catalog import Autoscaling
from core.openai_protocol import BACKGROUND_HEADER
from inference import background_turns
from inference.adapter_slots import AdapterSlots, FairUse
from inference.background_turns import BackgroundTurns
from inference.metrics import Metrics
from inference.server import create_app
from tests.fake_pool import INTERNAL, TOKEN, BufferedResponse, PoolUnderTest
from tests.inference_fixtures import BASE

QUIET_S = 0.3


@pytest.fixture
def anyio_backend():
    return "asyncio"


class HeldAnswers:
    """The replica's completions, each answered when the test releases it (by its prompt)."""

    def __init__(self) -> None:
        self.running: list[str] = []
        self._release: dict[str, asyncio.Event] = {}

    async def post(self, url: str, body: bytes, content_type: str = "application/json") -> BufferedResponse:
        prompt = json.loads(body)["messages"][0]["content"]
        self.running.append(prompt)
        try:
            await self._release.setdefault(prompt, asyncio.Event()).wait()
        finally:
            self.running.remove(prompt)
        return BufferedResponse(200, {}, json.dumps({"model": BASE, "choices": [], "usage": {}}).encode())

    def release(self, *prompts: str) -> None:
        for prompt in prompts:
            self._release.setdefault(prompt, asyncio.Event()).set()

    async def running_soon(self, *prompts: str) -> None:
        for _ in range(200):
            if all(prompt in self.running for prompt in prompts):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{prompts} never reached the replica; running: {self.running}")

    def background_running(self) -> list[str]:
        return sorted(prompt for prompt in self.running if prompt.startswith("line"))


@dataclass
class Backend:
    held: HeldAnswers
    ask: Callable[[str, bool], asyncio.Task]  # (prompt, background) -> the answer's status code
    in_flight: Callable[[], tuple[int, int]]  # the replica's requests in flight: all, background
    waits: Callable[[], float]  # background requests that waited for their turn


def _body(prompt: str) -> dict:
    return {"model": BASE, "messages": [{"role": "user", "content": prompt}]}


def _pool(tmp_path, held: HeldAnswers) -> Backend:
    pool = PoolUnderTest(tmp_path, replicas=1)
    app = create_app(pool.pool, pool.adapters, held, pool.metrics, TOKEN)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pool", headers=INTERNAL)

    async def status(prompt: str, background: bool) -> int:
        headers = {BACKGROUND_HEADER: "1"} if background else {}
        return (await http.post("/v1/chat/completions", json=_body(prompt), headers=headers)).status_code

    replica = pool.pool.replicas[0]
    return Backend(
        held, lambda prompt, background: asyncio.create_task(status(prompt, background)),
        lambda: (replica.status()["inflight"], replica.status()["background_inflight"]), lambda: _waits(pool.metrics),
    )


def _waits(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value("fineserve_background_waits_total", {"base_model": BASE}) or 0.0


ROUTED = contextvars.ContextVar("routed", default="")  # the multiplexed model id Ray routed a request by


class RayReplicaStandIn:
    """A Ray Serve replica's own answer path (``VllmReplica.answer``: its turns, then the request to
    vLLM), with no Ray and no engine: the adapter "loaded" at once, vLLM the test's held answers."""

    def __init__(self, held: HeldAnswers, monkeypatch, fair_use: FairUse | None = None) -> None:
        from inference.ray_serve import replica as ray_replica
        from inference.ray_serve.idle_engine import IdleEngine

        monkeypatch.setattr(ray_replica, "_multiplexed_model_id", ROUTED.get)
        self.module, self.metrics = ray_replica, Metrics()
        self.replica = object.__new__(ray_replica.VllmReplica)  # no vLLM server started
        self.replica.url, self.replica.http = "http://replica", held
        self.replica.model = SimpleNamespace(
            id=BASE, engine=SimpleNamespace(max_loras=8), lora=SimpleNamespace(max_num_adapters_per_replica=8),
            autoscaling=Autoscaling(min_replicas=1, target_ongoing_requests=16, downscale_delay_s=600, cold_start_wait_s=60),
        )
        self.replica.turns = BackgroundTurns(self.metrics.background_waits.labels(BASE).inc)  # as VllmReplica makes it
        self.replica.adapters = SimpleNamespace(
            slots=AdapterSlots(8, fair_use), slots_of=lambda name: (name,), ensure=self._loaded
        )
        self.replica.inflight_by_model = Counter()
        self.replica.idle = IdleEngine(self.replica.model, None, "http://replica")  # always on: never asleep
        self.replica.adapter = self._loaded

    async def _loaded(self, routed_as: str, organization: str | None = None) -> None:
        pass

    def ask(self, prompt: str, background: bool = False, adapter: str = "", organization: str | None = None) -> asyncio.Task:
        """The answer's status code, for a request Ray routed by ``adapter`` ("": the base model)."""

        async def status() -> int:
            ROUTED.set(f"{BASE}:{adapter}@r1#publish" if adapter else "")
            body = json.dumps(_body(prompt)).encode()
            items = [item async for item in self.replica.answer("chat/completions", body, background, organization)]
            return items[1].status  # STARTED, then the Head

        return asyncio.create_task(status())


def _ray_replica(held: HeldAnswers, monkeypatch) -> Backend:
    ray = RayReplicaStandIn(held, monkeypatch)
    turns = ray.replica.turns
    return Backend(held, ray.ask, lambda: (turns.inflight, turns.background_inflight), lambda: _waits(ray.metrics))


@pytest.fixture(params=["pool", "ray"])
def backend(request, tmp_path, monkeypatch) -> Backend:
    monkeypatch.setattr(background_turns, "LIVE_QUIET_S", QUIET_S)
    held = HeldAnswers()
    return _pool(tmp_path, held) if request.param == "pool" else _ray_replica(held, monkeypatch)


@pytest.mark.anyio
async def test_background_work_runs_all_at_once_on_a_replica_with_no_live_requests(backend):
    held, ask = backend.held, backend.ask
    lines = [ask(f"line-{n}", True) for n in range(4)]
    await held.running_soon("line-0", "line-1", "line-2", "line-3")
    held.release("line-0", "line-1", "line-2", "line-3")
    assert [await line for line in lines] == [200] * 4
    assert backend.waits() == 0


@pytest.mark.anyio
async def test_beside_live_requests_background_work_runs_one_at_a_time_and_live_requests_never_wait(backend):
    held, ask = backend.held, backend.ask
    live = [ask("live-0", False)]
    await held.running_soon("live-0")
    lines = [ask(f"line-{n}", True) for n in range(3)]
    await held.running_soon("line-0")
    await asyncio.sleep(0.1)
    assert held.background_running() == ["line-0"]  # the others wait for their turn
    assert backend.in_flight() == (2, 1)

    live.append(ask("live-1", False))  # a live request does not queue behind them
    await held.running_soon("live-1")
    held.release("line-0")
    await held.running_soon("line-1")
    assert held.background_running() == ["line-1"]

    held.release("live-0", "live-1")  # the live requests end; the batch has the replica after a quiet moment
    await asyncio.sleep(QUIET_S / 3)
    assert held.background_running() == ["line-1"]
    await held.running_soon("line-2")
    assert held.background_running() == ["line-1", "line-2"]
    held.release("line-1", "line-2")
    assert [await request for request in live + lines] == [200] * 5
    assert backend.in_flight() == (0, 0)
    assert backend.waits() == 2  # for operators: how often batches gave way


@pytest.mark.anyio
async def test_on_a_ray_replica_an_organization_over_its_batch_share_waits_while_another_is_answered(monkeypatch):
    """The pool's own case is tests/test_adapter_fair_use.py's; here a Ray Serve replica's batch turns."""
    held = HeldAnswers()
    ray = RayReplicaStandIn(held, monkeypatch, FairUse(share=4, mixes=8, batch_share=1))
    other = ray.ask("theirs", adapter="b0", organization="b")  # another organization's request under way
    first = ray.ask("ours-1", adapter="a1", organization="a")
    await held.running_soon("theirs", "ours-1")
    second = ray.ask("ours-2", adapter="a2", organization="a")  # a second adapter of a's: over its share of 1
    again = ray.ask("ours-1 again", adapter="a1", organization="a")  # the adapter it has under way: not held back
    await held.running_soon("ours-1 again")
    await asyncio.sleep(0.2)
    assert "ours-2" not in held.running
    held.release("ours-1", "ours-1 again")  # its own requests end: its other adapter's turn
    await held.running_soon("ours-2")
    held.release("theirs", "ours-2")
    assert [await task for task in (other, first, second, again)] == [200] * 4

    monkeypatch.setattr(ray.module, "BATCH_TURN_WAIT_S", 0.2)
    other, first = ray.ask("theirs-2", adapter="b0", organization="b"), ray.ask("ours-3", adapter="a1", organization="a")
    await held.running_soon("theirs-2", "ours-3")
    assert await asyncio.wait_for(ray.ask("ours-4", adapter="a2", organization="a"), 5) == 429  # adapter_slots_busy
    held.release("theirs-2", "ours-3")
    assert [await other, await first] == [200, 200]


@pytest.mark.anyio
async def test_on_a_ray_replica_an_organization_alone_uses_every_batch_slot(monkeypatch):
    held = HeldAnswers()
    ray = RayReplicaStandIn(held, monkeypatch, FairUse(share=4, mixes=8, batch_share=1))
    asked = [ray.ask(f"ours-{n}", adapter=f"a{n}", organization="a") for n in range(3)]
    await held.running_soon("ours-0", "ours-1", "ours-2")  # nobody else waits: all three at once
    held.release("ours-0", "ours-1", "ours-2")
    assert [await task for task in asked] == [200] * 3
