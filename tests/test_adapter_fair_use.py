"""Fair use of a replica's adapter slots among organizations (``inference.adapter_slots``), against
the fake vLLM replicas of tests/fake_pool.py: which adapter goes when an organization
asks for more than its share, and what it is told when none of its own can go.

Each request names its organization in the header the gateway sets (``ORGANIZATION_HEADER``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Self

import httpx
import pytest

from core.catalog import load_catalog
from core.env import ConfigError
from inference import adapter_slots, adapters
from tests.fake_pool import _settle
from tests.helpers import anyio_backend  # noqa: F401 (a fixture)
from tests.inference_fixtures import BASE
from tests.mix_pool import MixesAnswering, TenantPool
from tests.ray_tenants import tenants_on

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def no_unload_grace(monkeypatch):
    monkeypatch.setattr(adapter_slots, "UNLOAD_GRACE_S", 0.0)


@pytest.fixture(params=["pool", "ray"])
def replica_of(request, tmp_path, monkeypatch):
    """A replica of a given capacity on either backend (tests/ray_tenants.py): Ray's replicas keep
    the adapters the pool's would, not Ray's least recently used."""
    return lambda max_adapters: tenants_on(request.param, tmp_path, max_adapters, monkeypatch)


async def test_an_organizations_flood_of_mixes_evicts_its_own_mixes_never_another_organizations_adapters(tmp_path):
    pool = TenantPool(tmp_path, replicas=1, max_adapters=8)
    theirs = [pool.publish(f"b{i}") for i in range(4)]
    for name in theirs:
        assert (await pool.chat_as("b", name)).status_code == 200
    flooder = pool.publish_real("a", seed=1)
    for step in range(20):  # 20 mixes, each of its own scale: 20 adapters
        response = await pool.mix_as("a", flooder, 0.05 * (step + 1))
        assert response.status_code == 200, response.text
        if step % 5 == 4:
            for name in theirs:  # the other organization keeps using its own
                assert (await pool.chat_as("b", name)).status_code == 200
        await _settle()
    assert {pool.served(name) for name in theirs} <= pool.held()
    assert all(len(pool.loads_of(name)) == 1 for name in theirs)  # never evicted, never loaded again
    assert len(pool.mixes_held()) == 4  # half the replica: the flooder's share while another holds adapters


async def test_an_organization_alone_holds_at_most_its_cap_of_mixes_and_may_fill_the_rest_with_adapters(tmp_path):
    pool = TenantPool(tmp_path, replicas=1, max_adapters=16)
    part = pool.publish_real("a", seed=1)
    mixes = []
    for step in range(10):
        response = await pool.mix_as("a", part, 0.1 * (step + 1))
        assert response.status_code == 200
        mixes.append(response.json()["model"])
        await _settle()
    assert pool.mixes_held() == set(mixes[2:])  # the default cap: 8 distinct mixes per organization and replica
    assert [call[2] for call in pool.vllm.unloads()] == mixes[:2]  # its own least recently used went
    plain = [pool.publish(f"own{i}") for i in range(8)]
    for name in plain:
        assert (await pool.chat_as("a", name)).status_code == 200
        await _settle()
    assert len(pool.held()) == 16  # alone, it may use the whole replica


async def test_an_organization_within_its_share_makes_room_from_the_organization_over_its_share(replica_of):
    pool = replica_of(4)
    oldest = pool.publish("b-oldest")
    assert (await pool.chat_as("b", oldest)).status_code == 200
    heavy = [pool.publish(f"a{i}") for i in range(3)]
    for name in heavy:
        assert (await pool.chat_as("a", name)).status_code == 200
    assert (await pool.chat_as("b", pool.publish("b-new"))).status_code == 200
    await _settle()
    # b's first adapter is the least recently used, but a holds 3 of 4, over its share of 2: a's goes.
    assert [call[2] for call in pool.vllm.unloads()] == [pool.served(heavy[0])]
    assert pool.served(oldest) in pool.held()


async def test_it_refuses_a_new_mix_with_429_when_every_adapter_of_the_organization_is_answering(tmp_path, monkeypatch):
    monkeypatch.setattr(adapter_slots, "OWN_ROOM_WAIT_S", 0.2)
    pool = TenantPool(tmp_path, replicas=1, max_adapters=4)
    theirs = [pool.publish(f"b{i}") for i in range(2)]
    for name in theirs:
        assert (await pool.chat_as("b", name)).status_code == 200
    part = pool.publish_real("a", seed=1)
    async with MixesAnswering(pool) as answering:
        running = [asyncio.create_task(pool.mix_as("a", part, scale)) for scale in (0.1, 0.2)]
        await _settle()
        # Its share is 2, both answering: nothing of its own can go (and no answer comes while held).
        refused = await asyncio.wait_for(pool.mix_as("a", part, 0.3), 5)
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "adapter_slots_busy" and refused.headers["retry-after"]
        assert "replica-0" not in error["message"] and "http" not in error["message"]  # no internal detail
        assert {pool.served(name) for name in theirs} <= pool.held() and pool.vllm.unloads() == []
        assert len(pool.mixes_held()) == 2  # the refused mix was not loaded
        answering.released.set()
        assert [(await task).status_code for task in running] == [200, 200]
    assert (await pool.mix_as("a", part, 0.3)).status_code == 200  # once one is idle, it makes room
    await _settle()
    assert {pool.served(name) for name in theirs} <= pool.held()


async def test_a_new_mix_waits_for_one_of_the_organizations_own_adapters_to_finish_rather_than_failing(tmp_path):
    pool = TenantPool(tmp_path, replicas=1, max_adapters=4)
    theirs = [pool.publish(f"b{i}") for i in range(2)]
    for name in theirs:
        assert (await pool.chat_as("b", name)).status_code == 200
    part = pool.publish_real("a", seed=1)
    async with MixesAnswering(pool) as answering:
        running = [asyncio.create_task(pool.mix_as("a", part, scale)) for scale in (0.1, 0.2)]
        await _settle()
        waiting = asyncio.create_task(pool.mix_as("a", part, 0.3))
        await _settle()
        assert not waiting.done()
        answering.released.set()
        assert (await waiting).status_code == 200
        assert [(await task).status_code for task in running] == [200, 200]
    assert {pool.served(name) for name in theirs} <= pool.held()


async def test_requests_without_an_organization_share_the_replica_as_before(replica_of):
    pool = replica_of(2)
    names = [pool.publish(f"x{i}") for i in range(3)]
    for name in names:
        assert (await pool.chat(name)).status_code == 200
    await _settle()
    assert [call[2] for call in pool.vllm.unloads()] == [pool.served(names[0])]  # plain least recently used


def test_the_catalog_sets_the_fair_use_of_a_replica_and_refuses_nonsense(tmp_path):
    def catalog(lines: str):
        path = tmp_path / "models.toml"
        path.write_text(
            f'[[models]]\nid = "{BASE}"\nweights = "w"\n[models.lora_config]\nmax_num_adapters_per_replica = 8\n{lines}\n'
        )
        return load_catalog(path, tmp_path, str(tmp_path / "dynamic")).get(BASE).lora

    defaults = catalog("")
    assert (defaults.max_mixes_per_organization, defaults.organization_share) == (8, 0.5)
    chosen = catalog("max_mixes_per_organization = 2\norganization_share = 0.75")
    assert (chosen.max_mixes_per_organization, chosen.organization_share) == (2, 0.75)
    for bad in ("organization_share = 0", "organization_share = 1.5", "organization_share = true",
                "max_mixes_per_organization = 0", 'organization_share = "half"'):
        with pytest.raises(ConfigError, match="lora_config"):
            catalog(bad)


class HeldAnswers:
    """Holds every completion at the replica until released, one at a time, by what its model contains."""

    def __init__(self, pool: TenantPool):
        self.answer, self.pending = pool.vllm.handler, []
        pool.client._transport = httpx.MockTransport(self.held)

    async def held(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions":
            released = asyncio.Event()
            self.pending.append((json.loads(request.content)["model"], released))
            await released.wait()
        return self.answer(request)

    def release(self, part: str) -> None:
        index = next(i for i, (model, _) in enumerate(self.pending) if part in model)
        self.pending.pop(index)[1].set()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for _, released in self.pending:
            released.set()


def _with_batch_share(pool: TenantPool, batch_share: int) -> None:
    """A replica of 8 adapters whose batches hold 2 * ``batch_share`` (vLLM's max_loras)."""
    replica = pool.pool.replicas[0]
    replica.adapters = adapter_slots.AdapterSlots(8, adapter_slots.FairUse(share=4, mixes=8, batch_share=batch_share))


async def test_an_organization_over_its_share_of_a_batch_waits_for_its_own_requests_while_another_is_answered(
    tmp_path, monkeypatch
):
    pool = TenantPool(tmp_path, replicas=1, max_adapters=8)
    _with_batch_share(pool, 2)
    theirs, part = pool.publish("b0"), pool.publish_real("a", seed=1)
    async with HeldAnswers(pool) as answers:
        other = asyncio.create_task(pool.chat_as("b", theirs))  # another organization's request under way
        running = [asyncio.create_task(pool.mix_as("a", part, scale)) for scale in (0.1, 0.2)]
        await _settle()
        third = asyncio.create_task(pool.mix_as("a", part, 0.3))
        await _settle()
        assert not third.done() and len(pool.mixes_held()) == 2  # waiting for its turn: not even loaded
        answers.release(":mix.")  # one of its two finishes: its third goes ahead
        await _settle()
        assert len(pool.mixes_held()) == 3 and len(answers.pending) == 3
        for _ in range(3):
            answers.release(":")
        assert [(await task).status_code for task in [other, *running, third]] == [200] * 4

    monkeypatch.setattr(adapters, "BATCH_TURN_WAIT_S", 0.1)
    async with HeldAnswers(pool) as answers:
        other = asyncio.create_task(pool.chat_as("b", theirs))
        running = [asyncio.create_task(pool.mix_as("a", part, scale)) for scale in (0.4, 0.5)]
        await _settle()
        refused = await asyncio.wait_for(pool.mix_as("a", part, 0.6), 5)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "adapter_slots_busy"
        assert "answering at once" in refused.json()["error"]["message"]


async def test_alone_an_organization_uses_every_batch_slot(tmp_path):
    pool = TenantPool(tmp_path, replicas=1, max_adapters=8)
    _with_batch_share(pool, 1)
    part = pool.publish_real("a", seed=1)
    async with HeldAnswers(pool) as answers:
        running = [asyncio.create_task(pool.mix_as("a", part, 0.1 * (step + 1))) for step in range(3)]
        await _settle()
        assert len(answers.pending) == 3  # nobody else waits: all three at the replica at once
        for _ in range(3):
            answers.release(":mix.")
        assert [(await task).status_code for task in running] == [200] * 3
