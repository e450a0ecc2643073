"""The fake pool of tests/fake_pool.py serving mixes of real (small) adapters, and the organizations
that ask for them (the header the gateway sets, ``ORGANIZATION_HEADER``)."""

from __future__ import annotations

import asyncio
import json
from typing import Self

import httpx

from core.openai_protocol import ORGANIZATION_HEADER
from tests.fake_pool import PoolUnderTest
from tests.inference_fixtures import BASE
from tests.lora_adapters import _adapter

REPLICA = "http://replica-0"


class MixPool(PoolUnderTest):
    def publish_real(self, suffix: str, rank: int = 8, seed: int = 1) -> str:
        name = f"{BASE}:{suffix}"
        folder = _adapter(
            self.tmp / "out" / f"{suffix}-{seed}", seed=seed, rank=rank, alpha=2 * rank, modules=["q_proj"]
        )
        self.store.publish(name, folder)
        return name

    async def mix(self, adapters: list, model: str = BASE):
        return await self.http.post(
            "/v1/chat/completions", json={"model": model, "messages": [], "adapters": adapters, "temperature": 0}
        )

    def sent(self) -> list[dict]:
        """The bodies of the completions the replicas received."""
        return [call for call in self.vllm.calls if call[1] == "/v1/chat/completions"]


class TenantPool(MixPool):
    async def chat_as(self, organization: str, model: str) -> httpx.Response:
        return await self.http.post(
            "/v1/chat/completions", json={"model": model, "messages": []}, headers={ORGANIZATION_HEADER: organization}
        )

    async def mix_as(self, organization: str, part: str, scale: float) -> httpx.Response:
        body = {"model": BASE, "messages": [], "adapters": [{"model": part, "scale": scale}]}
        return await self.http.post("/v1/chat/completions", json=body, headers={ORGANIZATION_HEADER: organization})

    def held(self) -> set[str]:
        return set(self.vllm.loaded.get(REPLICA, {}))

    def mixes_held(self) -> set[str]:
        return {name for name in self.held() if ":mix." in name}


def kernel_mixing(pool: MixPool) -> MixPool:
    """The pool's replicas compute mixes in their kernel (as they report it when they become ready)."""
    for replica in pool.pool.replicas:
        replica.lora_kernels = {"active": "fineserve", "requested": "fineserve", "mixes_in_kernel": True}
    return pool


class MixesAnswering:
    """Holds the replica's answers to mixes until ``release``: the organization's mixes stay in flight."""

    def __init__(self, pool: TenantPool):
        self.answer, self.released = pool.vllm.handler, asyncio.Event()
        pool.client._transport = httpx.MockTransport(self.held_until_released)

    async def held_until_released(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions" and ":mix." in json.loads(request.content)["model"]:
            await self.released.wait()
        return self.answer(request)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.released.set()  # a failed assertion must not leave requests waiting forever
