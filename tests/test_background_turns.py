"""Background work (a batch's lines, an evaluation's answers) yields to live requests in the pool:
beside live requests a replica runs one background request at a time, alone as many as come. Against
a replica stand-in that holds each answer until the test lets it go, so what runs at once is seen.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from core.openai_protocol import BACKGROUND_HEADER
from inference import replica as replica_module
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


@pytest.fixture
def held_pool(tmp_path, monkeypatch):
    monkeypatch.setattr(replica_module, "LIVE_QUIET_S", QUIET_S)
    pool = PoolUnderTest(tmp_path, replicas=1)
    held = HeldAnswers()
    app = create_app(pool.pool, pool.adapters, held, pool.metrics, TOKEN)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pool", headers=INTERNAL)

    def ask(prompt: str, background: bool) -> asyncio.Task:
        body = {"model": BASE, "messages": [{"role": "user", "content": prompt}]}
        headers = {BACKGROUND_HEADER: "1"} if background else {}
        return asyncio.create_task(http.post("/v1/chat/completions", json=body, headers=headers))

    return held, ask, pool.pool.replicas[0], pool.metrics


def waits(metrics) -> float:
    return metrics.registry.get_sample_value("fineserve_background_waits_total", {"base_model": BASE}) or 0.0


@pytest.mark.anyio
async def test_background_work_runs_all_at_once_on_a_replica_with_no_live_requests(held_pool):
    held, ask, _, metrics = held_pool
    lines = [ask(f"line-{n}", background=True) for n in range(4)]
    await held.running_soon("line-0", "line-1", "line-2", "line-3")
    held.release("line-0", "line-1", "line-2", "line-3")
    assert [(await line).status_code for line in lines] == [200] * 4
    assert waits(metrics) == 0


@pytest.mark.anyio
async def test_beside_live_requests_background_work_runs_one_at_a_time_and_live_requests_never_wait(held_pool):
    held, ask, replica, metrics = held_pool
    live = [ask("live-0", background=False)]
    await held.running_soon("live-0")
    lines = [ask(f"line-{n}", background=True) for n in range(3)]
    await held.running_soon("line-0")
    await asyncio.sleep(0.1)
    assert held.background_running() == ["line-0"]  # the others wait for their turn
    assert replica.status()["background_inflight"] == 1

    live.append(ask("live-1", background=False))  # a live request does not queue behind them
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
    assert [(await request).status_code for request in live + lines] == [200] * 5
    assert replica.inflight == 0 and replica.background_inflight == 0
    assert waits(metrics) == 2  # for operators: how often batches gave way
