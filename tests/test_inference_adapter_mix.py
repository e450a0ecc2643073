"""Mixes end to end on the real engine: official openai client (``extra_body``) -> gateway -> pool
-> vLLM (CPU). A mix answers as PEFT does with the same adapters merged at the same scales; scale
0 is the base model; mixed, scaled and plain requests share batches, each with its own answer (the
cases Ray's replicas run too are in tests/mix_cases.py).

The session's one engine (conftest's ``inference_pool``; test catalog: 3 adapters per replica,
max_lora_rank 16), whose kernel computes mixes from their parts' slots (``inference.engine.mixes``).
"""

# ruff: noqa: F811 (pytest fixtures are imported from tests.inference_fixtures, then named as arguments)
from __future__ import annotations

import httpx
import pytest

from tests.inference_fixtures import (  # noqa: F401 (fixtures)
    BASE,
    alice,
    gateway,
    internal_headers,
    make_adapter,
    publish_fine_tuned_model,
)
from tests import mix_cases
from tests.mix_cases import ask, chat, peft_mix_answer
from tests.served_answers import _suffix

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]


def _loaded_adapters() -> set[str]:
    from django.conf import settings

    pool = httpx.get(f"{settings.INFERENCE_POOL_URL}/health", headers=internal_headers(), timeout=10).json()
    replica = pool["replicas"][0]["url"]
    listing = httpx.get(f"{replica}/v1/models", headers=internal_headers(), timeout=10).json()
    return {card["id"] for card in listing["data"] if card.get("parent")}


def test_a_half_and_half_mix_answers_token_for_token_as_peft_with_the_two_adapters_merged(alice, make_adapter):
    mix_cases.a_half_and_half_mix_answers_as_peft(alice, make_adapter)


def test_a_mix_past_max_lora_rank_and_a_scale_alone_answer_as_peft_merges_them_computed_in_the_kernel(
    alice, make_adapter
):
    from django.conf import settings

    pool = httpx.get(f"{settings.INFERENCE_POOL_URL}/health", headers=internal_headers(), timeout=10).json()
    assert pool["replicas"][0]["lora_kernels"]["mixes_in_kernel"], pool["replicas"][0]["lora_kernels"]
    mix_cases.a_wide_mix_and_a_scale_alone_answer_as_peft(alice, make_adapter)


def test_a_mix_at_scale_0_answers_as_the_base_model_and_loads_no_adapter(alice, make_adapter):
    name = publish_fine_tuned_model(alice, _suffix("zero"), make_adapter(seed=2))
    before = _loaded_adapters()
    answer = chat(alice.client, adapters=[{"model": name, "scale": 0}])
    assert answer.model == BASE and answer.choices[0].message.content == ask(alice.client)
    assert _loaded_adapters() <= before  # nothing was loaded for it
    assert ask(alice.client, name) != ask(alice.client)  # the adapter itself does change the answer


def test_mixed_scaled_and_plain_requests_in_one_batch_each_get_their_own_answer(alice, make_adapter):
    mix_cases.mixed_scaled_and_plain_requests_in_one_batch_get_their_own_answers(alice, make_adapter)


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
    assert ask(alice.client, composed) == ask(alice.client, adapters=parents) == peft_mix_answer(folders, [0.5, 0.5])
