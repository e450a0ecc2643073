"""Bring your own base model, as a user does it: ``add_base_model`` adds a second base model of
another architecture (a tiny Qwen2, ``tests.second_base_model``) to a catalog beside SmolLM2, then
``bin/run`` serves both. With the official ``openai`` client: both are listed, a fine-tune of each
trains and answers under its own name, an adapter trained elsewhere for the second is uploaded and
answers, and two of the second model's adapters mix; a mix never takes the other model's. In a real
browser, the dashboard's pickers, models page and usage page show both models' fine-tunes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import openai
import pytest
import redis

from tests.adapter_archives import _archive
from tests.browser import screenshot
from tests.inference_fixtures import AdapterMaker, catalog_text, kernels_for
from tests.personas import good_dataset
from tests.processes import ROOT, wait_until
from tests.running_platform import bin_run, shipped_models
from tests.second_base_model import build_tiny_qwen2

pytestmark = [pytest.mark.product, pytest.mark.engine, pytest.mark.training]

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"
QWEN = "tests/tiny-qwen2"
REDIS_URL = "redis://127.0.0.1:6379/11"
FINISHED = ("succeeded", "failed", "cancelled")


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    root = tmp_path_factory.mktemp("two-models")
    data = root / "data"
    shipped_models(data)
    catalog = root / "models.toml"
    catalog.write_text(catalog_text(adapters=4))
    added = subprocess.run(  # as an operator adds a model: the management command
        [sys.executable, "manage.py", "add_base_model", str(build_tiny_qwen2(root / "tiny-qwen2")), "--id", QWEN],
        cwd=ROOT, env={**_without_platform_settings(), "MODEL_CATALOG": str(catalog), "DATA_DIR": str(data), "DEBUG": "true"},
        capture_output=True, text=True, timeout=300,
    )
    assert added.returncode == 0, added.stderr
    assert f"Added {QWEN}" in added.stdout and "GiB per replica" in added.stdout
    redis.Redis.from_url(REDIS_URL).flushdb()
    with bin_run(data, REDIS_URL, settings={"MODEL_CATALOG": str(catalog)}) as running:
        yield running


def _without_platform_settings() -> dict[str, str]:
    import os

    from tests.running_platform import _PLATFORM_VARIABLES

    return {name: value for name, value in os.environ.items() if name not in _PLATFORM_VARIABLES}


def _fine_tune(client: openai.OpenAI, model: str, suffix: str) -> str:
    training = client.files.create(file=("train.jsonl", good_dataset(10)), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model=model, training_file=training.id, suffix=suffix, hyperparameters={"n_epochs": 1}
    )
    deadline = time.monotonic() + 420
    while (job := client.fine_tuning.jobs.retrieve(job.id)).status not in FINISHED:
        assert time.monotonic() < deadline, f"{model}'s job is still {job.status}"
        time.sleep(0.5)
    assert job.status == "succeeded", job.error
    return job.fine_tuned_model


def test_both_base_models_are_listed_fine_tuned_and_served_side_by_side(platform, page, tmp_path):
    client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.api_key, max_retries=0)
    api = httpx.Client(
        base_url=f"{platform.url}/v1", headers={"Authorization": f"Bearer {platform.api_key}"}, timeout=120
    )
    assert {SMOL, QWEN} <= {model.id for model in client.models.list().data}
    ready = lambda: all(replica["lora_kernels"] for replica in platform.pool_health()["replicas"])  # noqa: E731
    wait_until(ready, 300, "both models' replicas")  # /healthz answers once the first is ready
    replicas = platform.pool_health()["replicas"]
    assert sorted(replica["model"] for replica in replicas) == sorted([SMOL, QWEN])
    for replica in replicas:
        kernels = replica["lora_kernels"]
        expected = kernels_for(replica["model"], platform.data_dir.parent / "models.toml", platform.data_dir)
        assert (kernels["active"], kernels["mixes_in_kernel"]) == expected, replica

    tuned = {model: _fine_tune(client, model, "side") for model in (SMOL, QWEN)}
    question = [{"role": "user", "content": "What is 2 plus 2?"}]

    def ask(model: str, adapters: list | None = None) -> openai.types.chat.ChatCompletion:
        extra = {"extra_body": {"adapters": adapters}} if adapters else {}
        return client.chat.completions.create(model=model, messages=question, max_tokens=8, temperature=0, **extra)

    for base, name in tuned.items():
        assert name == f"{base}:side"
        assert ask(name).model == f"{name}@r1" and ask(name).choices[0].message.content

    folder = AdapterMaker(tmp_path / "elsewhere", QWEN, platform.data_dir / "models" / QWEN)(seed=5)
    uploaded = api.post(
        "/fine_tuning/adapters",
        files={"file": ("adapter.tar.gz", _archive(folder))},
        data={"model": QWEN, "suffix": "elsewhere"},
    )
    assert uploaded.status_code == 200, uploaded.text
    elsewhere = uploaded.json()["id"]
    assert ask(elsewhere).choices[0].message.content != ask(QWEN).choices[0].message.content

    mixed = ask(QWEN, [{"model": tuned[QWEN], "scale": 0.5}, {"model": elsewhere, "scale": 0.5}])
    assert mixed.model.startswith(f"{QWEN}:mix.") and mixed.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as refused:  # a part of the other base model
        ask(SMOL, [{"model": elsewhere, "scale": 0.5}])
    assert refused.value.code == "adapter_of_another_base_model" and refused.value.param == "adapters"

    time.sleep(6)  # the web process writes what it counted every 5 s
    today = int(time.time()) // 86400 * 86400
    usage = api.get("/organization/usage/completions", params={"start_time": today, "group_by": "model"})
    served = {row["model"] for bucket in usage.json()["data"] for row in bucket["results"]}
    assert {tuned[SMOL], tuned[QWEN], elsewhere} <= served, json.dumps(usage.json())[:500]

    # The dashboard, in a real browser: the pickers, the models page and the usage page show both.
    platform.sign_in(page)
    page.goto(f"{platform.url}/jobs/new")
    assert page.eval_on_selector_all("#id_model option", "options => options.map(o => o.value)") == [SMOL, QWEN]
    page.goto(f"{platform.url}/playground")
    offered = page.eval_on_selector_all("#pane-1 select.model option", "options => options.map(o => o.value)")
    assert {SMOL, QWEN, tuned[SMOL], tuned[QWEN], elsewhere} <= set(offered), offered
    page.goto(f"{platform.url}/models")
    assert all(page.is_visible(f'tr[data-model="{name}"]') for name in (tuned[SMOL], tuned[QWEN], elsewhere))
    page.goto(f"{platform.url}/usage")
    totals = page.inner_text("#usage-totals")
    assert all(name in totals for name in (tuned[SMOL], tuned[QWEN], elsewhere)), totals
    screenshot(page, "product-two-models-usage")
