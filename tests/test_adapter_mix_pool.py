"""Mixes in the pool (``inference.adapters.ensure_mix``), against the fake vLLM replicas of
tests/fake_pool.py: what is built, loaded, evicted and refused."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from inference import adapter_slots, engine_contract
from tests.fake_pool import _settle
from tests.helpers import anyio_backend  # noqa: F401 (a fixture)
from tests.inference_fixtures import BASE
from tests.mix_pool import MixPool
from tests.ray_tenants import tenants_on


@pytest.fixture(autouse=True)
def no_unload_grace(monkeypatch):
    monkeypatch.setattr(adapter_slots, "UNLOAD_GRACE_S", 0.0)


@pytest.mark.anyio
async def test_it_loads_a_mix_as_one_adapter_once_whatever_the_order_of_its_parts(tmp_path):
    pool = MixPool(tmp_path, replicas=1, max_adapters=2)
    a, b = pool.publish_real("a", seed=1), pool.publish_real("b", seed=2)
    first = await pool.mix([{"model": a, "scale": 0.5}, {"model": b, "scale": 0.5}])
    again = await pool.mix([{"model": b, "scale": 0.5}, {"model": a, "scale": 0.5}])
    assert first.status_code == again.status_code == 200, first.text
    mix_name = first.json()["model"]
    assert mix_name.startswith(f"{BASE}:mix.") and again.json()["model"] == mix_name
    assert [call[2] for call in pool.vllm.loads()] == [mix_name]  # the parts themselves are not loaded
    folder = pool.vllm.loaded["http://replica-0"][mix_name]
    config = json.loads((tmp_path / "cache" / ".mixes" / folder.rpartition("/")[2] / "adapter_config.json").read_text())
    assert config["r"] == config["lora_alpha"] == 16
    assert [call[2] for call in pool.sent()] == [mix_name, mix_name]
    other = await pool.mix([{"model": a, "scale": 0.25}, {"model": b, "scale": 0.5}])
    assert other.json()["model"] not in (mix_name, BASE)  # another scale, another adapter


@pytest.mark.anyio
async def test_it_answers_with_the_base_model_when_every_scale_is_0(tmp_path):
    pool = MixPool(tmp_path, replicas=1)
    a = pool.publish_real("a")
    response = await pool.mix([{"model": a, "scale": 0}, {"model": a, "scale": 0.0}])
    assert response.status_code == 200 and response.json()["model"] == BASE
    assert pool.vllm.loads() == []


@pytest.mark.anyio
async def test_it_refuses_a_mix_over_max_lora_rank_naming_the_limit(tmp_path):
    pool = MixPool(tmp_path, replicas=1)
    a, b, c = (pool.publish_real(suffix, seed=seed) for seed, suffix in enumerate("abc"))
    response = await pool.mix([{"model": a}, {"model": b}, {"model": c}])
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "mix_rank_too_large" and error["param"] == "adapters"
    assert "rank 24" in error["message"] and "max_lora_rank 16" in error["message"]
    assert pool.vllm.loads() == [] and not list((tmp_path / "cache").glob(".mixes/*"))


@pytest.mark.anyio
async def test_it_evicts_mixes_like_adapters_and_deletes_their_folders(tmp_path):
    pool = MixPool(tmp_path, replicas=1, max_adapters=2)
    a, b = pool.publish_real("a", seed=1), pool.publish_real("b", seed=2)
    for scale in (0.1, 0.2, 0.3):
        assert (await pool.mix([{"model": a, "scale": scale}])).status_code == 200
    await _settle()
    assert len(pool.vllm.loaded["http://replica-0"]) == 2
    assert len(list((tmp_path / "cache" / ".mixes").iterdir())) == 2  # the evicted one's folder is gone
    assert (await pool.chat(b)).status_code == 200  # a plain adapter takes a slot like any mix
    await _settle()
    assert len(pool.vllm.loaded["http://replica-0"]) == 2


@pytest.mark.anyio
async def test_a_republished_or_deleted_part_retires_the_mix(tmp_path):
    pool = MixPool(tmp_path, replicas=1)
    a = pool.publish_real("a", seed=1)
    old = (await pool.mix([{"model": a, "scale": 0.5}])).json()["model"]
    pool.publish_real("a", seed=9)  # republished: new weights, a new version
    new = (await pool.mix([{"model": a, "scale": 0.5}])).json()["model"]
    assert new != old
    await pool.adapters.retire_deleted()
    await _settle()
    assert set(pool.vllm.loaded["http://replica-0"]) == {new}
    pool.store.delete(a)
    await pool.adapters.retire_deleted()
    await _settle()
    assert pool.vllm.loaded["http://replica-0"] == {} and not list((tmp_path / "cache" / ".mixes").iterdir())
    response = await pool.mix([{"model": a, "scale": 0.5}])
    assert response.status_code == 404 and response.json()["error"]["param"] == "adapters"


@pytest.mark.anyio
async def test_it_refuses_a_mix_on_a_fine_tuned_model_or_of_another_base(tmp_path):
    pool = MixPool(tmp_path, replicas=1)
    a = pool.publish_real("a")
    on_fine_tune = await pool.mix([{"model": a}], model=a)
    assert on_fine_tune.status_code == 400 and on_fine_tune.json()["error"]["code"] == "mix_needs_base_model"
    elsewhere = await pool.mix([{"model": "other/base:x"}])
    assert elsewhere.status_code == 404 and elsewhere.json()["error"]["param"] == "adapters"
    bad_scale = await pool.mix([{"model": a, "scale": "0.5"}])
    assert bad_scale.status_code == 400 and "adapters.0.scale" in bad_scale.json()["error"]["message"]


# --- where the replica's kernel computes mixes (inference.engine.mixes) ----------------------------


@pytest.fixture(params=["pool", "ray"])
def kernel_replica(request, tmp_path, monkeypatch):
    """A replica whose kernel computes mixes, of a given capacity, on either backend (tests/ray_tenants.py)."""
    return lambda max_adapters: tenants_on(request.param, tmp_path, max_adapters, monkeypatch)


@pytest.mark.anyio
async def test_where_the_kernel_mixes_it_loads_the_parts_and_a_manifest_of_them_and_builds_nothing(kernel_replica):
    pool = kernel_replica(8)
    a, b = pool.publish_real("a", seed=1), pool.publish_real("b", seed=2)
    first = await pool.mix([{"model": a, "scale": 0.5}, {"model": b, "scale": -1.0}])
    assert first.status_code == 200, first.text
    mix_name = first.json()["model"]
    assert [call[2] for call in pool.vllm.loads()] == [pool.served(a), pool.served(b), mix_name]
    folder = Path(pool.vllm.loaded["http://replica-0"][mix_name])
    manifest = json.loads((folder / engine_contract.MANIFEST).read_text())
    assert manifest == {
        "parts": [{"adapter": pool.served(a), "scale": 0.5}, {"adapter": pool.served(b), "scale": -1.0}]
    }
    assert [path.name for path in folder.parent.iterdir()] == [folder.name]  # no adapter built
    other = await pool.mix([{"model": a, "scale": 0.25}])  # another scale: its manifest only
    assert other.status_code == 200 and [call[2] for call in pool.vllm.loads()][3:] == [other.json()["model"]]


@pytest.mark.anyio
async def test_a_kernel_mix_may_sum_past_max_lora_rank_but_not_take_more_parts_than_the_batch_slots(kernel_replica):
    pool = kernel_replica(8)
    a, b, c = (pool.publish_real(suffix, seed=seed, rank=16) for seed, suffix in enumerate("abc"))
    wide = await pool.mix([{"model": a}, {"model": b}])  # rank 32 > 16: each part fits, no sum is built
    assert wide.status_code == 200, wide.text
    loads = len(pool.vllm.loads())
    response = await pool.mix([{"model": a}, {"model": b}, {"model": c}])  # three parts, two batch slots
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "mix_too_many_parts" and error["param"] == "adapters"
    assert "names 3 adapters" in error["message"] and "Mix at most 2" in error["message"]
    assert len(pool.vllm.loads()) == loads  # nothing loaded for it


@pytest.mark.anyio
async def test_an_organization_alone_holds_more_kernel_mixes_than_its_cap_of_built_ones(kernel_replica):
    pool = kernel_replica(16)
    part = pool.publish_real("a", seed=1)
    for step in range(10):  # ten distinct scales: ten mixes, past the cap of 8 built ones
        assert (await pool.mix_as("a", part, 0.1 * (step + 1))).status_code == 200
        await _settle()
    assert len(pool.mixes_held()) == 10 and pool.vllm.unloads() == []


@pytest.mark.anyio
async def test_kernel_mixes_make_room_among_themselves_and_never_evict_an_adapter_of_a_full_replica(kernel_replica):
    pool = kernel_replica(3)
    part = pool.publish_real("a", seed=1)
    adapters = [pool.served(name) for name in (part, pool.publish("b"), pool.publish("c"))]
    for name in (part, "b", "c"):
        assert (await pool.chat(name if name == part else f"{BASE}:{name}")).status_code == 200
    mixes = []
    for step in range(5):  # the replica holds 3 adapters, its capacity: each new mix wants room
        response = await pool.mix([{"model": part, "scale": 0.1 * (step + 1)}])
        assert response.status_code == 200, response.text
        mixes.append(response.json()["model"])
        await _settle()
    held = set(pool.vllm.loaded["http://replica-0"])
    assert set(adapters) <= held  # no adapter went back to the store for a mix that weighs nothing
    assert held - set(adapters) == set(mixes[-3:])  # as many mixes as adapters, the least recently used went
    assert sorted(call[2] for call in pool.vllm.unloads()) == sorted(mixes[:2])


@pytest.mark.anyio
async def test_a_kernel_mixs_parts_are_not_evicted_while_it_answers(kernel_replica):
    from tests.mix_pool import MixesAnswering

    pool = kernel_replica(2)
    a = pool.publish_real("a", seed=1)
    others = [pool.publish(f"other{i}") for i in range(3)]
    async with MixesAnswering(pool) as answering:
        mixing = asyncio.create_task(pool.mix_as("x", a, 0.5))
        await _settle()
        for name in others:  # the replica is full: each wants room while the mix's part answers
            assert (await pool.chat_as("y", name)).status_code == 200
            await _settle()
        assert pool.served(a) not in [call[2] for call in pool.vllm.unloads()]
        answering.released.set()
        assert (await mixing).status_code == 200
