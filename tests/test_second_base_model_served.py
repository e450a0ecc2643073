"""Two base models of different architectures side by side on one pool, with the real engine.

The second is a tiny Qwen2 (biases on q/k/v, grouped-query attention, a hidden size of 64: other
shapes than SmolLM2's Llama) built in the test (``tests.second_base_model``) and added with
``add_base_model``, as an operator adds one, in float32 (on a CPU with native bf16 it would pick
bfloat16, where vLLM's own LoRA kernels serve and greedy tokens drift from PEFT's float32 ones:
the product test with two models runs that). Its pool serves both: each has its own replica, whose
LoRA kernel passed its start-up checks; an adapter of the second model passes the upload check and
answers token for token as PEFT does on that model, alone and mixed (``inference.engine.mixes``); a
mix never takes a part of the other base model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from tests.inference_fixtures import BASE, AdapterMaker, adapter_store, internal_headers, pool_environment
from tests.processes import free_port, running, wait_until
from tests.second_base_model import build_tiny_qwen2

pytestmark = pytest.mark.engine

QWEN = "tests/tiny-qwen2"
PROMPT = "The capital of France is"
TOKENS = 8


def _peft_tokens(model_folder: Path, adapters: list[Path], scales: list[float]) -> list[int]:
    """PEFT's greedy tokens on the tiny model with these adapters merged at these scales
    (``add_weighted_adapter(cat)``: the exact sum of the scaled deltas)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    base = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapters[0], adapter_name="part0")
    for index, folder in enumerate(adapters[1:], start=1):
        model.load_adapter(folder, adapter_name=f"part{index}")
    model.add_weighted_adapter(
        [f"part{i}" for i in range(len(adapters))], scales, adapter_name="mix", combination_type="cat"
    )
    model.set_adapter("mix")
    prompt = tokenizer(PROMPT, return_tensors="pt")
    output = model.generate(**prompt, max_new_tokens=TOKENS, do_sample=False, min_new_tokens=TOKENS)
    return output[0, prompt["input_ids"].shape[1] :].tolist()


def _served_tokens(pool: str, model: str, adapters: list[dict] | None = None) -> list[int]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "min_tokens": TOKENS, "temperature": 0}
    body |= {"return_token_ids": True, "ignore_eos": True}
    if adapters is not None:
        body["adapters"] = adapters
    response = httpx.post(f"{pool}/v1/completions", json=body, headers=internal_headers(), timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def two_models(tmp_path_factory, machine_to_itself) -> tuple[str, Path, Path]:
    """A pool of its own whose catalog lists SmolLM2 and the tiny Qwen2, added with add_base_model:
    its URL, the tiny model's folder as added, and its data folder."""
    from django.conf import settings

    from finetuning.base_models.intake import CatalogPlace, NewBaseModel, add_base_model

    root = tmp_path_factory.mktemp("two-models")
    data = root / "data"
    (data / "models" / "HuggingFaceTB").mkdir(parents=True)
    shipped = settings.CONFIG.data_dir / "models" / BASE
    (data / "models" / BASE).symlink_to(shipped.resolve())
    catalog = root / "models.toml"
    catalog.write_text(Path(pool_environment()["MODEL_CATALOG"]).read_text())
    place = CatalogPlace(catalog, data, settings.CONFIG.dynamic_lora_path)
    added = add_base_model(NewBaseModel(build_tiny_qwen2(root / "tiny-qwen2"), QWEN, dtype="float32"), place)
    url = f"http://127.0.0.1:{free_port()}"
    environment = {
        "MODEL_CATALOG": str(catalog), "DATA_DIR": str(data), "INFERENCE_POOL_URL": url,
        "FIRST_REPLICA_PORT": str(free_port()),
    }
    with running("pool-two-models", [sys.executable, "-m", "inference"], environment) as process:

        def both_ready() -> bool:
            try:
                models = httpx.get(f"{url}/health", headers=internal_headers(), timeout=10).json()["models"]
            except (httpx.HTTPError, ValueError):
                return False
            return all(models.get(model, {}).get("state") == "ready" for model in (BASE, QWEN))

        wait_until(both_ready, 600, "both models' replicas", process)
        yield url, added.model.weights, data


def test_each_base_model_has_its_own_replica_with_the_checked_kernel(two_models):
    url, _, _ = two_models
    replicas = httpx.get(f"{url}/health", headers=internal_headers(), timeout=10).json()["replicas"]
    assert sorted(replica["model"] for replica in replicas) == sorted([BASE, QWEN])
    for replica in replicas:
        kernels = replica["lora_kernels"]
        assert kernels["active"] == "fineserve" and kernels["mixes_in_kernel"], (replica["model"], kernels)
        listed = httpx.get(f"{replica['url']}/v1/models", headers=internal_headers(), timeout=10).json()["data"]
        assert [card["id"] for card in listed] == [replica["model"]]


def test_the_second_models_adapters_pass_the_upload_check_and_answer_as_peft_alone_and_mixed(two_models, tmp_path):
    from core.adapter_check import check_adapter
    from core.catalog import load_catalog

    url, weights, data = two_models
    catalog = load_catalog(Path(data).parent / "models.toml", data, "")
    qwen = catalog.require(QWEN)
    folders = [AdapterMaker(tmp_path, QWEN, weights)(seed) for seed in (3, 4)]
    names = [f"{QWEN}:second-{index}" for index in range(2)]
    for name, folder in zip(names, folders):
        assert check_adapter(folder, qwen).rank == 8  # what an upload for this model goes through
        adapter_store().publish(name, folder)

    base = _served_tokens(url, QWEN)
    alone = _served_tokens(url, names[0])
    assert alone == _peft_tokens(weights, folders[:1], [1.0]) and alone != base
    mix = [{"model": names[0], "scale": 0.5}, {"model": names[1], "scale": -1.25}]
    mixed = _served_tokens(url, QWEN, mix)
    assert mixed == _peft_tokens(weights, folders, [0.5, -1.25])
    assert mixed not in (alone, base)
    assert _served_tokens(url, BASE)  # the first model answers beside it


def test_a_mix_refuses_a_part_of_the_other_base_model(two_models):
    url, _, _ = two_models
    body = {"model": BASE, "prompt": PROMPT, "max_tokens": 2, "adapters": [{"model": f"{QWEN}:second-0"}]}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=internal_headers(), timeout=60)
    error = response.json()["error"]
    assert response.status_code == 404 and error["param"] == "adapters", response.text
    assert f"{QWEN}:second-0" in error["message"]


def test_the_trainer_renders_a_tool_conversation_of_the_second_model_as_its_replica_does(two_models):
    from tests.served_answers import assert_trained_as_served

    url, weights, _ = two_models
    assert_trained_as_served(url, QWEN, weights)
