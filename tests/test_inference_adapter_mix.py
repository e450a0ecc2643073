"""Mixes end to end on the real engine: official openai client (``extra_body``) -> gateway -> pool
-> vLLM (CPU). A mix answers as PEFT does with the same adapters merged at the same scales; scale
0 is the base model; mixed, scaled and plain requests share batches, each with its own answer.

The session's one engine (conftest's ``inference_pool``; test catalog: 3 adapters per replica,
max_lora_rank 16), whose kernel computes mixes from their parts' slots (``inference.engine.mixes``).
"""

# ruff: noqa: F811 (pytest fixtures are imported from tests.inference_fixtures, then named as arguments)
from __future__ import annotations

import threading
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from tests.inference_fixtures import (  # noqa: F401 (fixtures)
    BASE,
    alice,
    gateway,
    internal_headers,
    make_adapter,
    publish_fine_tuned_model,
)
from tests.processes import ROOT

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOKENS = 16


def _suffix(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex[:8]}"


def _chat(client: openai.OpenAI, model: str = BASE, adapters: list | None = None):
    extra = {"extra_body": {"adapters": adapters}} if adapters is not None else {}
    return client.chat.completions.create(model=model, messages=QUESTION, max_tokens=TOKENS, temperature=0, **extra)


def _ask(client: openai.OpenAI, model: str = BASE, adapters: list | None = None) -> str:
    return _chat(client, model, adapters).choices[0].message.content


def _peft_mix_answer(folders: list[Path], scales: list[float]) -> str:
    """The greedy answer of the base model in PEFT with these adapters merged at these scales
    (``add_weighted_adapter``, ``combination_type="cat"``: the exact sum of the scaled deltas)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights = ROOT / "data" / "models" / BASE
    tokenizer = AutoTokenizer.from_pretrained(weights)
    base = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, folders[0], adapter_name="part0")
    for index, folder in enumerate(folders[1:], start=1):
        model.load_adapter(folder, adapter_name=f"part{index}")
    names = [f"part{index}" for index in range(len(folders))]
    model.add_weighted_adapter(names, scales, adapter_name="mix", combination_type="cat")
    model.set_adapter("mix")
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = model.generate(**prompt, max_new_tokens=TOKENS, do_sample=False)
    return tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)


def _loaded_adapters() -> set[str]:
    from django.conf import settings

    pool = httpx.get(f"{settings.INFERENCE_POOL_URL}/health", headers=internal_headers(), timeout=10).json()
    replica = pool["replicas"][0]["url"]
    listing = httpx.get(f"{replica}/v1/models", headers=internal_headers(), timeout=10).json()
    return {card["id"] for card in listing["data"] if card.get("parent")}


def test_a_half_and_half_mix_answers_token_for_token_as_peft_with_the_two_adapters_merged(alice, make_adapter):
    # Seeds 2 and 9: their half-and-half mix answers unlike the base model and unlike either alone,
    # so a wrong scale, a part left out or a mixed-up alpha shows as different text.
    folders = [make_adapter(seed=2), make_adapter(seed=9)]
    first, second = (publish_fine_tuned_model(alice, _suffix(f"half{i}"), folder) for i, folder in enumerate(folders))
    answer = _chat(alice.client, adapters=[{"model": first, "scale": 0.5}, {"model": second, "scale": 0.5}])
    served = answer.choices[0].message.content
    assert answer.model.startswith(f"{BASE}:mix.")
    assert served == _peft_mix_answer(folders, [0.5, 0.5])
    assert served not in (_ask(alice.client), _ask(alice.client, first), _ask(alice.client, second))


def test_a_mix_past_max_lora_rank_and_a_scale_alone_answer_as_peft_merges_them_computed_in_the_kernel(
    alice, make_adapter
):
    """The kernel adds each part at its scale: nothing is built, so the parts' ranks (8 + 16) may sum
    past max_lora_rank (16), where a built adapter was refused; a negative scale and one adapter at a
    scale of its own are as exact."""
    from django.conf import settings

    pool = httpx.get(f"{settings.INFERENCE_POOL_URL}/health", headers=internal_headers(), timeout=10).json()
    assert pool["replicas"][0]["lora_kernels"]["mixes_in_kernel"], pool["replicas"][0]["lora_kernels"]
    folders = [make_adapter(seed=2), make_adapter(seed=42, rank=16)]
    first, second = (publish_fine_tuned_model(alice, _suffix(f"wide{i}"), folder) for i, folder in enumerate(folders))
    mixed = _ask(alice.client, adapters=[{"model": first, "scale": 1.5}, {"model": second, "scale": -0.5}])
    assert mixed == _peft_mix_answer(folders, [1.5, -0.5])
    scaled = _ask(alice.client, adapters=[{"model": second, "scale": 1.75}])
    assert scaled == _peft_mix_answer(folders[1:], [1.75])
    assert len({mixed, scaled, _ask(alice.client, second), _ask(alice.client)}) == 4


def test_a_mix_at_scale_0_answers_as_the_base_model_and_loads_no_adapter(alice, make_adapter):
    name = publish_fine_tuned_model(alice, _suffix("zero"), make_adapter(seed=2))
    before = _loaded_adapters()
    answer = _chat(alice.client, adapters=[{"model": name, "scale": 0}])
    assert answer.model == BASE and answer.choices[0].message.content == _ask(alice.client)
    assert _loaded_adapters() <= before  # nothing was loaded for it
    assert _ask(alice.client, name) != _ask(alice.client)  # the adapter itself does change the answer


def test_mixed_scaled_and_plain_requests_in_one_batch_each_get_their_own_answer(alice, make_adapter):
    first = publish_fine_tuned_model(alice, _suffix("batch-a"), make_adapter(seed=2))
    second = publish_fine_tuned_model(alice, _suffix("batch-b"), make_adapter(seed=9))
    requests = {
        "plain": (first, None),
        "scaled": (BASE, [{"model": first, "scale": 0.5}]),
        "mixed": (BASE, [{"model": first, "scale": 0.5}, {"model": second, "scale": 0.5}]),
        "base": (BASE, None),
    }
    alone = {label: _ask(alice.client, model, adapters) for label, (model, adapters) in requests.items()}
    assert len(set(alone.values())) == 4  # four different answers, so a mix-up would show
    together: dict[str, str] = {}

    def ask(label: str) -> None:
        together[label] = _ask(alice.client, *requests[label])

    threads = [threading.Thread(target=ask, args=(label,)) for label in requests for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert together == alone


def test_a_composed_model_is_served_on_its_first_request_as_the_same_mix_answers(alice, gateway, make_adapter):
    # A composition keeps a mix under a name: the linear one is the same exact sum, so the same tokens.
    folders = [make_adapter(seed=2), make_adapter(seed=9)]
    first, second = (publish_fine_tuned_model(alice, _suffix(f"parent{i}"), folder) for i, folder in enumerate(folders))
    parents = [{"model": first, "scale": 0.5}, {"model": second, "scale": 0.5}]
    created = httpx.post(
        f"{gateway}/v1/fine_tuning/models", headers={"Authorization": f"Bearer {alice.api_key}"}, timeout=120,
        json={"parents": parents, "suffix": _suffix("composed")},
    )
    assert created.status_code == 200, created.text
    composed = created.json()["id"]
    assert _ask(alice.client, composed) == _ask(alice.client, adapters=parents) == _peft_mix_answer(folders, [0.5, 0.5])
