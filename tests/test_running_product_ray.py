"""The product as it runs with a model on Ray Serve: ``bin/run`` with a catalog whose model says
``backend = "ray"`` (scaled to zero, kept asleep), driven from outside.

``bin/run`` installs Ray and starts Ray Serve beside its other processes; ``/healthz`` says the
model is asleep (Serve keeps one replica, its engine asleep); an adapter trained elsewhere is
uploaded; the official ``openai`` client streams the base model's answer from the replica woken for
it, then gets the adapter's, and a mix of it at scale 1 answers as it does; ``/v1/models`` and the dashboard's models page (in a
real browser) say on how many replicas it runs; the usage API counted it.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.adapter_archives import _archive
from tests.browser import screenshot
from tests.inference_fixtures import BASE, AdapterMaker, catalog_text
from tests.processes import free_port, wait_until
from tests.running_platform import bin_run

pytestmark = [pytest.mark.product, pytest.mark.engine]

REDIS_URL = "redis://127.0.0.1:6379/14"  # the platform's own database: neither the suite's nor a user's
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    redis.Redis.from_url(REDIS_URL).flushdb()
    catalog = tmp_path_factory.mktemp("catalog") / "models.toml"
    catalog.write_text(catalog_text("ray", autoscaling="min_replicas = 0\ncold_start_wait_s = 20"))
    settings = {"MODEL_CATALOG": str(catalog), "RAY_SERVE_URL": f"http://127.0.0.1:{free_port()}"}
    with bin_run(tmp_path_factory.mktemp("platform-ray"), REDIS_URL, settings=settings) as running:
        yield running


def test_bin_run_serves_a_model_on_ray_serve_from_asleep_to_the_browser(platform, page, tmp_path):
    def health() -> str:
        answer = httpx.get(
            f"{platform.url}/healthz", headers={"Authorization": f"Bearer {platform.internal_token}"}, timeout=30
        )
        return answer.json()["checks"]["inference_pool"]["detail"]

    wait_until(lambda: f"Ray Serve: {BASE} asleep, 0 ready" in health(), 300, "the Ray replica to fall asleep")

    api = httpx.Client(
        base_url=f"{platform.url}/v1", headers={"Authorization": f"Bearer {platform.api_key}"}, timeout=120
    )
    uploaded = api.post(
        "/fine_tuning/adapters", files={"file": ("adapter.tar.gz", _archive(AdapterMaker(tmp_path)(seed=2)))},
        data={"model": BASE, "suffix": "on-ray"},
    )
    assert uploaded.status_code == 200, uploaded.text
    adapter = uploaded.json()["id"]

    client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.api_key, max_retries=10)  # as users run it
    started, first_token_s, parts = time.monotonic(), None, []
    for chunk in client.chat.completions.create(model=BASE, messages=QUESTION, max_tokens=12, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            first_token_s = first_token_s or time.monotonic() - started
            parts.append(chunk.choices[0].delta.content)
    print(f"\nbin/run on Ray Serve: first streamed token from asleep in {first_token_s:.2f} s")
    base = client.chat.completions.create(model=BASE, messages=QUESTION, max_tokens=12, temperature=0)
    assert "".join(parts) == base.choices[0].message.content  # woken, it answers as awake
    tuned = client.chat.completions.create(model=adapter, messages=QUESTION, max_tokens=12, temperature=0)
    assert "Paris" in base.choices[0].message.content
    assert tuned.model == f"{adapter}@r1" and tuned.choices[0].message.content != base.choices[0].message.content
    # A mix per request (the adapter at scale 1 is the adapter itself, computed by the mix kernel).
    mixed = client.chat.completions.create(
        model=BASE, messages=QUESTION, max_tokens=12, temperature=0, extra_body={"adapters": [{"model": adapter, "scale": 1}]}
    )
    assert mixed.model.startswith(f"{BASE}:mix.") and mixed.choices[0].message.content == tuned.choices[0].message.content
    assert client.models.retrieve(BASE).serving == {"state": "loaded", "replicas": 1}
    # The operator's scraper sees the Ray-backed model's series on the platform's /metrics, as the
    # pool's (the monitoring token is INTERNAL_TOKEN's value when none is set).
    scraped = httpx.get(f"{platform.url}/metrics", headers={"Authorization": f"Bearer {platform.internal_token}"}, timeout=30)
    assert scraped.status_code == 200, scraped.text
    answered = {
        sample.labels["model"]: sample.value
        for family in text_string_to_metric_families(scraped.text)
        for sample in family.samples
        if sample.name == "fineserve_inference_requests_total" and sample.labels.get("status") == "200"
    }
    assert answered.get(adapter) == 1 and answered.get(f"{BASE}:mix") == 1 and answered.get(BASE, 0) >= 1, answered

    platform.sign_in(page)
    page.goto(f"{platform.url}/models")
    assert page.inner_text(f'tr[data-model="{BASE}"] .serving-cell').strip() == "loaded on 1 replica"
    screenshot(page, "product-ray-models")
