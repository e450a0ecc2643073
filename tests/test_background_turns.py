"""Background work (a batch's lines, an evaluation's answers) yields to live requests, on the embedded
pool and on a Ray Serve replica alike: beside live requests a replica runs one background request at a
time, alone as many as come. Against a vLLM stand-in that holds each answer until the test lets it go,
so what runs at once is seen. On Ray, the replica's own answer path (``VllmReplica.answer``, which the
ingress calls with the request's background mark) is driven without Ray or an engine.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest

from core.openai_protocol import BACKGROUND_HEADER
from inference import background_turns
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


def _ray_replica(held: HeldAnswers, monkeypatch) -> Backend:
    from inference.ray_serve import replica as ray_replica

    monkeypatch.setattr(ray_replica, "_multiplexed_model_id", lambda: "")  # the base model's requests
    replica = object.__new__(ray_replica.VllmReplica)  # its answer path only: no vLLM server started
    metrics = Metrics()
    replica.url, replica.http = "http://replica", held
    replica.turns = BackgroundTurns(metrics.background_waits.labels(BASE).inc)  # as VllmReplica makes it

    async def status(prompt: str, background: bool) -> int:
        items = [item async for item in replica.answer("chat/completions", json.dumps(_body(prompt)).encode(), background)]
        return items[1].status  # STARTED, then the Head

    return Backend(
        held, lambda prompt, background: asyncio.create_task(status(prompt, background)),
        lambda: (replica.turns.inflight, replica.turns.background_inflight), lambda: _waits(metrics),
    )


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
