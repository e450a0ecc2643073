"""The product as it runs with its model scaled to zero and kept asleep: ``bin/run`` with a catalog
whose model says ``min_replicas = 0`` (``idle = "sleep"``, the default), driven from outside.

``/healthz``, ``/v1/models`` and the dashboard's models page (in a real browser) say the model is
asleep; the official ``openai`` client streams from it, and from an adapter trained elsewhere and
uploaded, each time after the model fell asleep again: the replica wakes in its own process (no
restart) and streams what it answers once awake, token for token. The time to each first token is
printed; ``benchmarks/cold_start_timeline.py --wake`` measures it.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import redis

from tests.adapter_archives import _archive
from tests.browser import screenshot
from tests.inference_fixtures import BASE, AdapterMaker, catalog_text
from tests.processes import wait_until
from tests.running_platform import bin_run

pytestmark = [pytest.mark.product, pytest.mark.engine]

REDIS_URL = "redis://127.0.0.1:6379/15"  # the platform's own database: neither the suite's nor a user's
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
IDLE_S = 3  # downscale_delay_s: the model falls asleep this long after its last request


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    redis.Redis.from_url(REDIS_URL).flushdb()
    catalog = tmp_path_factory.mktemp("catalog") / "models.toml"
    catalog.write_text(catalog_text("embedded", autoscaling=f"min_replicas = 0\ndownscale_delay_s = {IDLE_S}"))
    with bin_run(tmp_path_factory.mktemp("platform-serverless"), REDIS_URL, settings={"MODEL_CATALOG": str(catalog)}) as running:
        yield running


def test_bin_run_keeps_a_model_scaled_to_zero_asleep_and_wakes_it_for_the_openai_clients_stream(platform, page, tmp_path):
    client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.api_key)  # as users run it
    api = httpx.Client(base_url=f"{platform.url}/v1", headers={"Authorization": f"Bearer {platform.api_key}"}, timeout=60)
    uploaded = api.post(
        "/fine_tuning/adapters", files={"file": ("adapter.tar.gz", _archive(AdapterMaker(tmp_path)(seed=2)))},
        data={"model": BASE, "suffix": "asleep"},
    )
    assert uploaded.status_code == 200, uploaded.text
    adapter = uploaded.json()["id"]

    def asleep() -> bool:
        return (client.models.retrieve(BASE).serving or {}).get("state") == "asleep"

    wait_until(asleep, 120, "the model to fall asleep once its replica started")
    health = httpx.get(f"{platform.url}/healthz", headers={"Authorization": f"Bearer {platform.internal_token}"}, timeout=30)
    assert f"scaled to zero (wake or start on their next request): {BASE} (asleep)" in health.text
    platform.sign_in(page)
    page.goto(f"{platform.url}/models")
    assert page.inner_text(f'tr[data-model="{BASE}"] .serving-cell').strip().startswith("asleep: its next request wakes it")
    screenshot(page, "product-serverless-models")
    pid = platform.pool_health()["replicas"][0]["pid"]

    answers: dict[str, str] = {}
    for model in (BASE, adapter):
        wait_until(asleep, 60, f"the model to fall asleep again before {model}'s stream")
        started, first_token_s, parts = time.monotonic(), None, []
        stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0, stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first_token_s = first_token_s or time.monotonic() - started
                parts.append(chunk.choices[0].delta.content)
        awake = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0)
        assert "".join(parts) == awake.choices[0].message.content  # the same engine, woken: the same answer
        answers[model] = awake.choices[0].message.content
        print(f"\nbin/run, {model} asleep: first streamed token in {first_token_s:.2f} s")
    assert "Paris" in answers[BASE] and answers[adapter] != answers[BASE]
    replica = platform.pool_health()["replicas"][0]
    assert (replica["pid"], replica["restarts"]) == (pid, 0)  # woken twice in the process it started in
