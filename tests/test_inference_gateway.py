"""The public inference API end to end: official openai client -> gateway -> pool -> a real vLLM (CPU).

One engine for the whole session (conftest's ``inference_pool``, test catalog: 3 adapters per
replica). alice owns fine-tuned models; charlie is an outsider. Answers use temperature 0, so the
same model gives the same answer and different adapters give different ones.
"""

# ruff: noqa: F811 (pytest fixtures are imported from tests.inference_fixtures, then named as arguments)
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import openai
import pytest
from django.conf import settings
from gateway.access import GRANT_TTL_S
from inference.adapter_mix import is_mix_name

from tests.inference_fixtures import (  # noqa: F401 (fixtures)
    BASE,
    adapter_store,
    alice,
    charlie,
    gateway,
    internal_headers,
    make_adapter,
    monitoring_headers,
    publish_fine_tuned_model,
    register_fine_tuned_model,
)
from tests.processes import wait_until
from tests.served_answers import PLACE_FORMAT, QUESTION, _ask, _peft_answer, _suffix

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]


class ApiError:
    def __init__(self, exc: openai.APIStatusError):
        self.status_code = exc.status_code
        self.retry_after = exc.response.headers.get("retry-after")
        body = exc.body if isinstance(exc.body, dict) else {}
        self.body = body.get("error", body)  # the {"message", "type", "param", "code"} object


def _error(call) -> ApiError:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    return ApiError(caught.value)


def test_it_answers_with_the_base_model_and_reports_usage(alice):
    answer = alice.client.chat.completions.create(model=BASE, messages=QUESTION, max_tokens=24, temperature=0)
    assert "Paris" in answer.choices[0].message.content
    assert answer.model == BASE
    assert answer.usage.prompt_tokens > 0 and answer.usage.completion_tokens > 0
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_it_passes_sampling_parameters_through(alice):
    completion = alice.client.completions.create(
        model=BASE, prompt="Count: one, two, three,", max_tokens=3, temperature=0.7, top_p=0.9, seed=7, n=2
    )
    assert len(completion.choices) == 2
    assert completion.usage.completion_tokens == 6 and all(c.finish_reason == "length" for c in completion.choices)
    stopped = alice.client.completions.create(
        model=BASE, prompt="Count: one, two, three,", max_tokens=20, temperature=0, stop=[","]
    )
    assert "," not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"


def test_it_serves_an_adapter_published_while_the_pool_runs_on_its_first_request(alice, make_adapter):
    folder = make_adapter(seed=1)
    base_answer = _ask(alice.client, BASE)
    name = publish_fine_tuned_model(alice, _suffix("fresh"), folder)
    started = time.perf_counter()
    answer = alice.client.chat.completions.create(model=name, messages=QUESTION, max_tokens=24, temperature=0)
    assert time.perf_counter() - started < 30
    assert answer.model == f"{name}@r1"  # the revision that answered
    assert answer.choices[0].message.content != base_answer


def test_a_served_adapter_answers_token_for_token_as_peft_does_with_the_same_weights(alice, make_adapter):
    # Seed 2 moves the answer far from the base model's, so a wrong scale, a missed module or a
    # mixed-up adapter slot in the serving path shows as different text.
    folder = make_adapter(seed=2)
    name = publish_fine_tuned_model(alice, _suffix("as-peft"), folder)
    served = _ask(alice.client, name, max_tokens=16)
    assert served == _peft_answer(folder, max_tokens=16)
    assert served != _ask(alice.client, BASE, max_tokens=16)


def test_it_streams_tokens_and_usage(alice, make_adapter):
    name = publish_fine_tuned_model(alice, _suffix("stream"), make_adapter(seed=2))
    stream = alice.client.chat.completions.create(
        model=name, messages=QUESTION, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert len([chunk for chunk in chunks if chunk.choices]) > 3 and text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert text == _ask(alice.client, name, max_tokens=16)  # the same answer as without streaming


def test_it_serves_several_adapters_at_once_in_the_same_batches(alice, make_adapter):
    names = [publish_fine_tuned_model(alice, _suffix(f"many{seed}"), make_adapter(seed=seed)) for seed in (3, 4, 5)]
    alone = {name: _ask(alice.client, name, max_tokens=16) for name in names}
    arrivals: dict[str, list[float]] = {}
    answers: dict[str, str] = {}

    def stream(name: str) -> None:
        chunks = alice.client.chat.completions.create(
            model=name, messages=QUESTION, max_tokens=16, temperature=0, stream=True
        )
        parts = []
        for chunk in chunks:
            arrivals.setdefault(name, []).append(time.perf_counter())
            parts.append(chunk.choices[0].delta.content or "")
        answers[name] = "".join(parts)

    threads = [threading.Thread(target=stream, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == alone  # batched together, each with its own adapter
    # Continuous batching: every stream was still producing tokens while each other one was.
    spans = [(min(times), max(times)) for times in arrivals.values()]
    assert max(start for start, _ in spans) < min(end for _, end in spans)


def test_it_evicts_the_least_recently_used_adapter_and_answers_every_request(alice, make_adapter, gateway):
    names = [publish_fine_tuned_model(alice, _suffix(f"lru{seed}"), make_adapter(seed=seed)) for seed in range(10, 15)]
    evictions_before = _metric(gateway, "fineserve_adapter_evictions_total", 'reason="lru"')
    answers = {name: _ask(alice.client, name, max_tokens=4) for name in names}  # 5 adapters, room for 3
    assert all(answers.values())
    results: dict[str, str] = {}
    threads = [
        threading.Thread(target=lambda n=name: results.__setitem__(n, _ask(alice.client, n, max_tokens=4)))
        for name in names * 2
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == answers  # every request answered, by its own adapter, while adapters came and went
    assert _metric(gateway, "fineserve_adapter_evictions_total", 'reason="lru"') >= evictions_before + 2

    def within_capacity() -> bool:  # adapters still answering are evicted once idle
        # (the kernel's mixes, manifests of their parts, earlier tests' maybe, are held beside them)
        return len([name for name in _replica()["adapters"] if not is_mix_name(name)]) <= 3

    wait_until(within_capacity, 10, "eviction back to capacity")


def test_it_follows_json_mode_and_json_schemas_with_an_adapter(alice, make_adapter):
    name = publish_fine_tuned_model(alice, _suffix("json"), make_adapter(seed=6))
    answer = _ask(alice.client, name, max_tokens=60, response_format=PLACE_FORMAT)
    assert set(json.loads(answer)) == {"city", "country"}
    answer = alice.client.chat.completions.create(
        model=name, max_tokens=200, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Answer in JSON with a key 'capital': what is the capital of France?"}],
    )
    assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_it_lists_the_base_models_and_the_callers_own_fine_tuned_models(alice, charlie):
    name = register_fine_tuned_model(alice, _suffix("listed"))  # listed whether or not it is loaded
    models = {model.id: model for model in alice.client.models.list()}
    assert models[BASE].owned_by == "system"
    assert models[name].owned_by == alice.organization.slug and models[name].parent == BASE
    # Whether each runs: the base model on the session's one replica; the fine-tune loads on its first request.
    assert models[BASE].serving == {"state": "loaded", "replicas": 1}
    assert models[name].serving == {"state": "ready", "replicas": 0}
    assert alice.client.models.retrieve(name).id == name
    assert name not in {model.id for model in charlie.client.models.list()}
    assert BASE in {model.id for model in charlie.client.models.list()}


def test_it_answers_404_for_unknown_models_and_for_other_organizations_models(alice, charlie, make_adapter):
    name = publish_fine_tuned_model(alice, _suffix("private"), make_adapter(seed=7))
    for client, model in ((charlie.client, name), (alice.client, "gpt-4o"), (alice.client, f"{BASE}:never-trained")):
        error = _error(lambda client=client, model=model: _ask(client, model))
        assert error.status_code == 404
        assert error.body["code"] == "model_not_found" and error.body["param"] == "model"
        assert set(error.body) == {"message", "type", "param", "code"}
    assert _error(lambda: charlie.client.models.retrieve(name)).status_code == 404
    assert _ask(alice.client, name)  # still fine for its owner


def test_it_answers_401_without_a_valid_api_key(gateway):
    for key in ("sk-not-a-key", "nonsense"):
        client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0)
        error = _error(lambda client=client: _ask(client, BASE))
        assert error.status_code == 401 and error.body["code"] == "invalid_api_key"
    response = httpx.post(f"{gateway}/v1/chat/completions", json={"model": BASE, "messages": QUESTION})
    assert response.status_code == 401 and response.json()["error"]["code"] == "missing_api_key"


def test_it_answers_400_for_an_adapter_whose_rank_exceeds_max_lora_rank(alice, make_adapter):
    name = publish_fine_tuned_model(alice, _suffix("wide"), make_adapter(seed=8, rank=32))
    error = _error(lambda: _ask(alice.client, name))
    assert error.status_code == 400 and error.body["code"] == "adapter_rank_too_large"
    assert "max_lora_rank 16" in error.body["message"]
    assert "Paris" in _ask(alice.client, BASE)


def test_it_answers_500_for_a_broken_adapter_folder_and_keeps_serving(alice, make_adapter, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"r": 8, "base_model_name_or_path": BASE}))
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors at all")
    name = publish_fine_tuned_model(alice, _suffix("broken"), broken)
    error = _error(lambda: _ask(alice.client, name))
    assert error.status_code == 500 and error.body["code"] == "adapter_invalid"
    assert "Republish" in error.body["message"]
    assert "Paris" in _ask(alice.client, BASE)
    good = publish_fine_tuned_model(alice, _suffix("good"), make_adapter(seed=9))
    assert _ask(alice.client, good)


def test_it_answers_400_when_the_prompt_is_longer_than_the_context(alice):
    messages = [{"role": "user", "content": "hello " * 3000}]
    error = _error(lambda: alice.client.chat.completions.create(model=BASE, messages=messages, max_tokens=4))
    assert error.status_code == 400 and error.body["code"] == "context_length_exceeded"
    assert "2048" in error.body["message"]


def test_vllms_refusal_of_a_field_reaches_the_caller_in_its_words_without_urls_or_paths(alice):
    """vLLM validates the sampling fields the gateway passes through; its words tell the caller what
    to fix, but not where vLLM runs or which documentation page its validator links to."""
    refused = _error(lambda: alice.client.chat.completions.create(
        model=BASE, messages=QUESTION, max_tokens=4, extra_body={"top_k": "many"},
    ))
    message = refused.body["message"]
    assert refused.status_code == 400 and "top_k" in message, message
    assert not re.search(r"https?://|site-packages|127\.0\.0\.1|\.py\b", message), message


def test_it_reloads_a_republished_adapter_and_stops_serving_a_deleted_one(alice, make_adapter):
    suffix = _suffix("evolving")
    name = publish_fine_tuned_model(alice, suffix, make_adapter(seed=20))
    first = _ask(alice.client, name)
    adapter_store().publish(name, make_adapter(seed=21))  # retrained: a new version, same name
    second = _ask(alice.client, name)
    assert second != first
    adapter_store().delete(name)  # the adapter is gone but the row is still there
    error = _error(lambda: _ask(alice.client, name))
    assert error.status_code == 404 and error.body["code"] == "adapter_not_found"
    from finetuning.models import FineTunedModel

    FineTunedModel.objects.filter(name=name).delete()  # the model is deleted
    time.sleep(GRANT_TTL_S)  # the gateway remembers a granted model this long
    error = _error(lambda: _ask(alice.client, name))
    assert error.status_code == 404 and error.body["code"] == "model_not_found"


def test_it_exposes_prometheus_metrics_to_monitoring_only(alice, make_adapter, gateway):
    name = publish_fine_tuned_model(alice, _suffix("counted"), make_adapter(seed=42))
    _ask(alice.client, BASE, max_tokens=2)
    _ask(alice.client, name, max_tokens=2)
    refused = httpx.get(f"{gateway}/metrics")
    assert refused.status_code == 401 and BASE not in refused.text and name not in refused.text
    text = httpx.get(f"{gateway}/metrics", headers=monitoring_headers()).text
    assert f'model="{name}"' in text
    assert f'fineserve_inference_requests_total{{endpoint="chat/completions",model="{BASE}",status="200"}}' in text
    assert "fineserve_inference_request_seconds_bucket" in text
    assert 'fineserve_gateway_requests_total{endpoint="chat/completions",status="200"}' in text
    assert f'fineserve_replica_healthy{{model="{BASE}"' in text
    for name in (
        "fineserve_adapter_loads_total",
        "fineserve_adapter_evictions_total",
        "fineserve_adapter_load_seconds",
    ):
        assert name in text


def _metric(gateway: str, name: str, label: str) -> float:
    text = httpx.get(f"{gateway}/metrics", headers=monitoring_headers()).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name) and label in line)


def _pool_health() -> httpx.Response:
    return httpx.get(f"{settings.INFERENCE_POOL_URL}/health", headers=internal_headers())


def _replica() -> dict:
    return _pool_health().json()["replicas"][0]


def _loaded_in_vllm(replica_url: str) -> set[str]:
    cards = httpx.get(f"{replica_url}/v1/models", headers=internal_headers()).json()["data"]
    return {card["id"] for card in cards if card.get("parent")}


def test_a_replica_and_the_pool_refuse_whoever_lacks_the_internal_token(alice, make_adapter):
    name = publish_fine_tuned_model(alice, _suffix("guarded"), make_adapter(seed=43))
    answer = _ask(alice.client, name)  # loaded on the replica through the pool, with the token
    replica_url = _replica()["url"]
    stranger = {"Authorization": "Bearer a-local-process-guessing"}
    elsewhere = str(make_adapter(seed=44))
    refused = [
        ("POST", "/v1/load_lora_adapter", {"lora_name": f"{BASE}:planted", "lora_path": elsewhere}),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": name}),
        ("GET", "/v1/models", None),
        # Open under vLLM's own --api-key; closed by ours (inference.internal_auth.ReplicaGuard):
        ("POST", "/adapters", {"name": f"{BASE}:planted", "src": elsewhere}),
        ("DELETE", f"/adapters/{name}", None),
        ("POST", "/invocations", {"model": name, "prompt": "Hi", "max_tokens": 1}),
        ("GET", "/metrics", None),
    ]
    for method, path, body in refused:
        for headers in ({}, stranger):
            response = httpx.request(method, f"{replica_url}{path}", json=body, headers=headers, timeout=30)
            assert response.status_code == 401, (method, path, response.text)
    assert httpx.get(f"{settings.INFERENCE_POOL_URL}/health").status_code == 401
    pool_chat = {"model": name, "messages": QUESTION, "max_tokens": 4}
    assert httpx.post(f"{settings.INFERENCE_POOL_URL}/v1/chat/completions", json=pool_chat).status_code == 401
    assert _loaded_in_vllm(replica_url) >= {f"{name}@r1"} and f"{BASE}:planted" not in _loaded_in_vllm(replica_url)
    assert _ask(alice.client, name) == answer  # the platform itself still gets through


def test_deleting_a_model_lets_its_stream_finish_then_unloads_it_everywhere_within_seconds(alice, make_adapter):
    name = publish_fine_tuned_model(alice, _suffix("deleted"), make_adapter(seed=40))
    stream = alice.client.chat.completions.create(
        model=name, messages=QUESTION, max_tokens=48, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = [next(stream)]  # it is streaming
    assert alice.client.models.delete(name).deleted
    chunks += list(stream)
    assert sum(1 for chunk in chunks if chunk.choices and chunk.choices[0].delta.content) >= 40
    assert chunks[-1].choices[0].finish_reason == "length"  # the stream ran to its end
    replica_url, served = _replica()["url"], f"{name}@r1"
    deleted_at = time.monotonic()
    wait_until(lambda: served not in _loaded_in_vllm(replica_url), 15, "the deleted adapter to leave the replica")
    assert time.monotonic() - deleted_at < 10 and served not in _replica()["adapters"]  # no request needed


def test_a_new_pool_reads_back_what_a_running_replica_already_holds(alice, make_adapter):
    import asyncio

    from inference.replica import Replica

    name = publish_fine_tuned_model(alice, _suffix("held"), make_adapter(seed=41))
    _ask(alice.client, name)
    fresh = Replica(settings.MODEL_CATALOG.get(BASE), _replica()["url"])  # as a restarted pool sees it

    async def read_back() -> None:
        async with httpx.AsyncClient(headers=internal_headers()) as client:
            await fresh.read_back_adapters(client)

    asyncio.run(read_back())
    published = adapter_store().version(name)
    served = f"{name}@{published.version}"
    assert fresh.holds(served) and fresh.adapters.version(served) == published.identity  # the publish it holds


# Last: it restarts the session's engine.
def test_it_restarts_a_killed_replica_and_answers_503_meanwhile(alice, make_adapter):
    name = publish_fine_tuned_model(alice, _suffix("survivor"), make_adapter(seed=30))
    before = _ask(alice.client, name)
    replica = _replica()
    os.killpg(replica["pid"], signal.SIGKILL)
    error = _error(lambda: _ask(alice.client, BASE))
    # No replica, or (the kill raced this request) the one that had it: refused cleanly either way.
    assert error.status_code == 503 and error.body["code"] in ("no_replica_available", "replica_unavailable")
    assert "Retry" in error.body["message"] and int(error.retry_after) > 0
    wait_until(lambda: _pool_health().status_code == 200, 300, "replica restart")
    restarted = _replica()
    assert restarted["restarts"] == replica["restarts"] + 1 and restarted["pid"] != replica["pid"]
    assert _ask(alice.client, name) == before  # the adapter is loaded again on the new engine
