"""Fair use of a replica's adapter slots, end to end on a real vLLM (CPU): one organization floods
the replica with distinct mixes while another's adapters keep answering without being loaded again.

A pool and a gateway of its own: a replica of 8 adapters (the session's has 3, and no share), the
default share (half of it while another organization holds adapters) and cap of mixes. Prints the
figures for the README.
"""

# ruff: noqa: F811 (pytest fixtures are imported from tests.inference_fixtures, then named as arguments)
from __future__ import annotations

import statistics
import sys
import threading
import time
import uuid

import httpx
import pytest

from tests.inference_fixtures import (  # noqa: F401 (a fixture)
    BASE,
    _persona,
    catalog_text,
    internal_headers,
    make_adapter,
    publish_fine_tuned_model,
)
from tests.processes import ROOT, answers, free_port, running, running_web, wait_until

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

FLOOD = 100  # distinct mixes: one fine-tune, each at a scale of its own
FLOOD_THREADS = 4
QUIET_S = 0.5  # between two requests of the other organization: an ordinary tenant, not a hammer


@pytest.fixture(scope="module")
def fair_platform(test_database_url, machine_to_itself):
    """A pool (8 adapters a replica, half for one organization while another holds some) and a
    gateway in front of it; yields (gateway URL, pool URL)."""
    catalog = ROOT / "data" / "test" / "fair-use-models.toml"
    catalog.parent.mkdir(parents=True, exist_ok=True)
    catalog.write_text(catalog_text(adapters=8, organization_share=0.5))
    pool_url = f"http://127.0.0.1:{free_port()}"
    environment = {"MODEL_CATALOG": str(catalog), "INFERENCE_POOL_URL": pool_url}
    replica_port = {"FIRST_REPLICA_PORT": str(free_port())}
    with running("pool-fair-use", [sys.executable, "-m", "inference"], environment | replica_port) as pool:
        wait_until(lambda: answers(f"{pool_url}/health", headers=internal_headers()), 300, "the fair-use pool", pool)
        with running_web("gateway-fair-use", {"DATABASE_URL": test_database_url, **environment}) as gateway:
            yield gateway, pool_url


def _loads(pool_url: str) -> float:
    text = httpx.get(f"{pool_url}/metrics", headers=internal_headers()).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("fineserve_adapter_loads_total") and 'outcome="loaded"' in line
    )


def _held(pool_url: str) -> set[str]:
    return set(httpx.get(f"{pool_url}/health", headers=internal_headers()).json()["replicas"][0]["adapters"])


def test_one_organizations_flood_of_mixes_never_pushes_out_another_organizations_adapters(fair_platform, make_adapter):
    gateway, pool_url = fair_platform
    flooder, other = _persona("flooder", gateway), _persona("quiet", gateway)
    tag = uuid.uuid4().hex[:6]
    part = publish_fine_tuned_model(flooder, f"flood-{tag}", make_adapter(seed=50))
    theirs = [publish_fine_tuned_model(other, f"own{i}-{tag}", make_adapter(seed=40 + i)) for i in range(4)]
    web = httpx.Client(base_url=gateway, timeout=120)

    def ask(persona, **fields) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0, **fields}
        return web.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {persona.api_key}"})

    for name in theirs:
        assert ask(other, model=name).status_code == 200
    served = {f"{name}@r1" for name in theirs}
    assert served <= _held(pool_url)
    loads_before = _loads(pool_url)

    flood_answers: list[httpx.Response] = []
    their_statuses: list[int] = []
    their_seconds: list[float] = []
    their_missing: list[set[str]] = []  # of theirs not held, seen between their requests
    done = threading.Event()

    def flood(first: int) -> None:
        for step in range(first, FLOOD, FLOOD_THREADS):
            mix = [{"model": part, "scale": round(0.01 * (step + 1), 2)}]
            flood_answers.append(ask(flooder, model=BASE, adapters=mix))

    def keep_asking() -> None:
        while not done.is_set():
            for name in theirs:
                asked = time.monotonic()
                their_statuses.append(ask(other, model=name).status_code)
                their_seconds.append(time.monotonic() - asked)
                their_missing.append(served - _held(pool_url))
                time.sleep(QUIET_S)

    started = time.monotonic()
    quiet = threading.Thread(target=keep_asking)
    quiet.start()
    floods = [threading.Thread(target=flood, args=(first,)) for first in range(FLOOD_THREADS)]
    for thread in floods:
        thread.start()
    for thread in floods:
        thread.join()
    flood_s = time.monotonic() - started
    done.set()
    quiet.join()

    statuses = [answer.status_code for answer in flood_answers]
    mixes_loaded = len({answer.json()["model"] for answer in flood_answers if answer.status_code == 200})
    # Where the kernel computes mixes, the flooder's fine-tune is loaded too, once: the mixes' part.
    replica = httpx.get(f"{pool_url}/health", headers=internal_headers()).json()["replicas"][0]
    part_loads = 1 if replica["lora_kernels"]["mixes_in_kernel"] else 0
    their_reloads = _loads(pool_url) - loads_before - mixes_loaded - part_loads
    refused = [answer.json()["error"]["code"] for answer in flood_answers if answer.status_code != 200]
    print(
        f"\n{FLOOD} distinct mixes from one organization ({FLOOD_THREADS} at a time) in {flood_s:.1f} s: "
        f"{statuses.count(200)} answered, {len(refused)} refused {sorted(set(refused))}; the other organization's "
        f"{len(their_statuses)} requests on its 4 adapters: {their_statuses.count(200)} answered, "
        f"{int(their_reloads)} reloads, missing from the replica at {sum(bool(m) for m in their_missing)} checks, "
        f"answered in {statistics.median(their_seconds):.2f} s (median), {max(their_seconds):.2f} s at most"
    )
    assert set(refused) <= {"adapter_slots_busy"}  # what an organization over its share is told, if anything
    assert statuses.count(200) >= FLOOD * 0.9
    assert their_statuses and all(status == 200 for status in their_statuses)
    assert their_reloads == 0 and not any(their_missing)
    assert served <= _held(pool_url)
    # Built mixes count in the flooder's share (half of 8); the kernel's, weightless, are held beside
    # the adapters, 8 at most, and make room only among themselves.
    most_mixes = 8 if replica["lora_kernels"]["mixes_in_kernel"] else 4
    assert len({name for name in _held(pool_url) if ":mix." in name}) <= most_mixes
