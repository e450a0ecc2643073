"""The product as it runs: ``bin/run``'s own processes, driven from outside.

A user's path, step by step: the load balancer's ``/healthz``, then the official ``openai`` client
(upload, fine-tune, wait, stream a chat with the new model, list it, delete it); a function-calling
fine-tune asked about cities it never saw; a fine-tune started from the dashboard's form in a real
browser on the same web process; then adapters trained elsewhere, uploaded, mixed per request,
composed into a model and downloaded; a batch over the base model, fine-tunes and a mix, whose
completion a webhook announces; a preference (DPO) job; then a model fine-tuned again (r2), rolled
back to r1, and its checkpoints served by name; then one eval call comparing the base model, a
fine-tune, its r1 and a checkpoint; then the usage of it all, in the usage API and on the dashboard;
a job cancelled after its first checkpoint, whose checkpoints the sweeper deletes once their
retention is over; the Tinker SDK's quickstart and an RL loop, unchanged against the base URL; a
reinforcement fine-tuning job from the official client, checked against the base model on held-out
prompts by an eval; the hostile requests that once broke the platform; last, a key that spends its
minute of tokens. The timings a user feels are written to test-artifacts/product-timings.json.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import tarfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import redis
import tinker
from tinker import types

from tests.adapter_archives import _archive
from tests.browser import screenshot
from tests.inference_fixtures import BASE, AdapterMaker
from tests.personas import chat_example, good_dataset, jsonl, preference_dataset
from tests.processes import ROOT, SWEEPS_OFTEN, wait_until
from tests.running_platform import bin_run
from tests.tinker_examples import EXAMPLES, YES_OR_NO, chat_prompt, loss_per_token, process_example, rl_step
from tests.tool_calling import WEATHER_TOOL, assembled_tool_calls, held_out_prompts, weather_dataset

pytestmark = [pytest.mark.product, pytest.mark.engine, pytest.mark.training]

REDIS_URL = "redis://127.0.0.1:6379/13"  # the platform's own database: neither the suite's nor a user's
# Low enough for a few chats to reach it (each charged its prompt and max_tokens, or the whole
# 2,048-token context without max_tokens), as an operator's .env would set it.
TOKENS_PER_MINUTE_PER_KEY = 12_000
BATCH_QUEUE_TOKENS = 5_000  # prompt tokens of the organization's unfinished batches
TIMINGS = ROOT / "test-artifacts" / "product-timings.json"
FINISHED = ("succeeded", "failed", "cancelled")
# The function-calling fine-tune of 40 lines: docs/api.md's recipe for teaching a small model a tool.
TOOLS_LINES = 40
TOOLS_HYPERPARAMETERS = {
    "n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 10, "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0,
}


@pytest.fixture(scope="module")
def platform(tmp_path_factory):
    redis.Redis.from_url(REDIS_URL).flushdb()  # no message from an earlier run
    # No retention for a job that publishes nothing: its checkpoints go at the sweeper's next pass.
    settings = {
        "TOKENS_PER_MINUTE_PER_KEY": str(TOKENS_PER_MINUTE_PER_KEY), "UNPUBLISHED_CHECKPOINTS_DAYS": "0", **SWEEPS_OFTEN,
        "WEBHOOKS_ALLOW_PRIVATE_ADDRESSES": "true",  # an on-premises operator's: the test's receiver is on loopback
        "BATCH_QUEUE_TOKENS_PER_ORGANIZATION": str(BATCH_QUEUE_TOKENS),
    }
    with bin_run(tmp_path_factory.mktemp("platform"), REDIS_URL, settings=settings) as running:
        yield running


def wait_for_status(client: openai.OpenAI, job_id: str, statuses: tuple[str, ...], timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while (job := client.fine_tuning.jobs.retrieve(job_id)).status not in statuses:
        if time.monotonic() > deadline:
            events = [event.message for event in client.fine_tuning.jobs.list_events(job_id, limit=20).data]
            raise AssertionError(f"job {job_id} is still {job.status} after {timeout_s:.0f} s; events: {events}")
        time.sleep(0.25)
    return job


def pool_replicas(platform) -> list[dict]:
    return platform.pool_health()["replicas"]


def test_a_job_created_with_the_openai_client_trains_and_its_model_streams_then_deletes(platform):
    for _ in range(3):  # a load balancer's probes come first, as they do in production
        assert httpx.get(f"{platform.url}/healthz", timeout=10).status_code == 200
    client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.api_key, max_retries=0)

    training = client.files.create(file=("train.jsonl", good_dataset(10)), purpose="fine-tune")
    created_at = time.monotonic()
    job = client.fine_tuning.jobs.create(
        model=BASE, training_file=training.id, suffix="product", hyperparameters={"n_epochs": 1}
    )
    wait_for_status(client, job.id, ("running", *FINISHED), timeout_s=120)
    running_s = time.monotonic() - created_at
    job = wait_for_status(client, job.id, FINISHED, timeout_s=420)
    succeeded_s = time.monotonic() - created_at
    assert job.status == "succeeded", job.error
    assert job.fine_tuned_model == f"{BASE}:product"
    # The worker has the pool preload the model once it is published: its first request loads nothing.
    served = f"{job.fine_tuned_model}@r1"  # the replicas hold each revision under its own name
    ready = lambda: client.fine_tuning.jobs.list_events(job.id, limit=1).data[0].message  # noqa: E731
    wait_until(lambda: ready().startswith("Ready on 1 replica(s)"), 60, "the job's preload")
    assert any(served in replica["adapters"] for replica in pool_replicas(platform)), ready()

    stream = client.chat.completions.create(
        model=job.fine_tuned_model, messages=[{"role": "user", "content": "What is 2 plus 2?"}],
        max_tokens=16, temperature=0, stream=True,
    )
    pieces = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if not pieces:
                first_token_s = time.monotonic() - created_at
            pieces.append(chunk.choices[0].delta.content)
    assert len(pieces) >= 2 and "".join(pieces).strip(), "the answer did not stream"

    assert job.fine_tuned_model in [model.id for model in client.models.list()]
    kernels = [replica["lora_kernels"] for replica in pool_replicas(platform) if replica["healthy"]]
    assert kernels and all(k["reason"].startswith("the C kernel") for k in kernels), (
        kernels
    )  # built by bin/run's replica
    assert client.models.delete(job.fine_tuned_model).deleted
    wait_until(
        lambda: not any(served in replica["adapters"] for replica in pool_replicas(platform)),
        10, "the deleted model to leave every replica, with no request for it",
    )
    time.sleep(1.1)  # another web process may remember the grant for its GRANT_TTL_S
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=job.fine_tuned_model, messages=[{"role": "user", "content": "Hi"}])
    assert job.fine_tuned_model not in [model.id for model in client.models.list()]

    record_timings(created_to_running_s=running_s, created_to_succeeded_s=succeeded_s, created_to_first_token_s=first_token_s)


def record_timings(**timings: float) -> None:
    """Add these to the timings file (each test that measures some writes its own)."""
    TIMINGS.parent.mkdir(parents=True, exist_ok=True)
    recorded = json.loads(TIMINGS.read_text()) if TIMINGS.exists() else {}
    TIMINGS.write_text(json.dumps(recorded | timings, indent=2))


def calls_the_tool_for(client: openai.OpenAI, model: str, question: str, city: str, stream: bool) -> bool:
    """Whether the model, free to answer in words (``tool_choice`` auto), calls get_weather with the city."""
    asked = {"model": model, "messages": [{"role": "user", "content": question}], "tools": [WEATHER_TOOL]}
    asked |= {"tool_choice": "auto", "max_tokens": 40, "temperature": 0}
    if stream:
        calls = assembled_tool_calls(client.chat.completions.create(**asked, stream=True))
    else:
        calls = client.chat.completions.create(**asked).choices[0].message.tool_calls or []
    return [(call.function.name, json.loads(call.function.arguments)) for call in calls] == [("get_weather", {"city": city})]


def right_calls(client: openai.OpenAI, model: str, held_out: list[tuple[str, str]], stream: bool) -> int:
    """How many of the held-out questions the model answers with the right call, asked all at once as
    an agent's users would (the engine answers them in one batch, not one after another)."""
    with ThreadPoolExecutor(len(held_out)) as pool:
        return sum(pool.map(lambda asked: calls_the_tool_for(client, model, *asked, stream=stream), held_out))


def test_a_function_calling_fine_tune_calls_the_tool_for_cities_it_never_saw_and_answers_its_result(platform):
    # Retries: a minute of held-out questions at once may reach the key's tokens per minute (429, Retry-After).
    client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.api_key, max_retries=5)
    named = {"type": "function", "function": {"name": "get_weather"}}
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    forced = client.chat.completions.create(model=BASE, messages=question, tools=[WEATHER_TOOL], tool_choice=named, max_tokens=100, temperature=0)
    jsonschema.validate(json.loads(forced.choices[0].message.tool_calls[0].function.arguments), WEATHER_TOOL["function"]["parameters"])
    held_out = held_out_prompts()
    base_right = right_calls(client, BASE, held_out, stream=False)

    training = client.files.create(file=("weather.jsonl", weather_dataset(TOOLS_LINES)), purpose="fine-tune")
    created_at = time.monotonic()
    job = client.fine_tuning.jobs.create(
        model=BASE, training_file=training.id, suffix="weather", hyperparameters=TOOLS_HYPERPARAMETERS
    )
    job = wait_for_status(client, job.id, FINISHED, timeout_s=900)
    assert job.status == "succeeded", job.error
    trained_s = time.monotonic() - created_at
    model = job.fine_tuned_model
    right = right_calls(client, model, held_out, stream=False)
    streamed_right = right_calls(client, model, held_out, stream=True)
    record_timings(tools_job_created_to_succeeded_s=trained_s, tools_held_out_right_base=base_right,
                   tools_held_out_right_fine_tune=right, tools_held_out_right_streamed=streamed_right)
    assert 5 * right >= 4 * len(held_out) and 5 * streamed_right >= 4 * len(held_out), (base_right, right, streamed_right)

    ask = [{"role": "user", "content": "How is the weather in Helsinki?"}]
    call = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER_TOOL], max_tokens=40, temperature=0)
    message = call.choices[0].message
    assert call.choices[0].finish_reason == "tool_calls" and message.tool_calls
    report = json.dumps({"city": "Helsinki", "temperature_c": 3, "sky": "snowy"})
    ask += [message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": report}]
    answer = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER_TOOL], max_tokens=40, temperature=0)
    assert answer.choices[0].finish_reason == "stop" and "3" in answer.choices[0].message.content  # read the result

    text = client.responses.create(model=model, input="Say hello.", max_output_tokens=8)
    assert text.output_text and text.status in ("completed", "incomplete")
    flat_tool = {"type": "function", **WEATHER_TOOL["function"]}  # the Responses API's shape
    called = client.responses.create(model=model, input="What is the weather in Zurich today?", tools=[flat_tool],
                                     max_output_tokens=40, temperature=0)
    (call_item,) = [item for item in called.output if item.type == "function_call"]
    assert call_item.name == "get_weather" and json.loads(call_item.arguments)["city"]


def test_a_job_started_from_the_dashboard_form_trains_on_the_same_running_platform(platform, page, tmp_path):
    page.goto(f"{platform.url}/login")
    page.fill("#id_username", "demo")
    page.fill("#id_password", "demo")
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r"/jobs$"))

    (tmp_path / "arithmetic.jsonl").write_bytes(good_dataset(10))
    page.goto(f"{platform.url}/datasets")
    page.set_input_files("#id_file", str(tmp_path / "arithmetic.jsonl"))
    page.click("#upload-form button[type=submit]")
    page.wait_for_selector(".conversation")
    page.click("text=Fine-tune on it")
    page.fill("#id_suffix", "from-the-form")
    page.fill("#id_n_epochs", "1")
    page.click("#job-form button[type=submit]")
    page.wait_for_url(re.compile(r"/jobs/ftjob-"))

    page.wait_for_selector("#status.succeeded", timeout=420_000)
    assert page.inner_text("#model-name") == f"{BASE}:from-the-form"
    screenshot(page, "product-dashboard-job-succeeded")


def _uploaded_adapters(api: httpx.Client, folder, suffixes: dict[int, str]) -> list[str]:
    """Adapters "trained elsewhere" (random LoRA weights in PEFT's format, one per seed) uploaded
    under these suffixes: their names."""
    make_adapter, names = AdapterMaker(folder), []
    for seed, suffix in suffixes.items():
        uploaded = api.post(
            "/fine_tuning/adapters", files={"file": ("adapter.tar.gz", _archive(make_adapter(seed)))},
            data={"model": BASE, "suffix": suffix},
        )
        assert uploaded.status_code == 200, uploaded.text
        names.append(uploaded.json()["id"])
    return names


def test_uploaded_adapters_mix_per_request_and_compose_into_a_model_served_on_its_first_request(platform, tmp_path):
    client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.api_key, max_retries=0)
    api = httpx.Client(
        base_url=f"{platform.url}/v1", headers={"Authorization": f"Bearer {platform.api_key}"}, timeout=120
    )
    names = _uploaded_adapters(api, tmp_path, {2: "elsewhere-a", 9: "elsewhere-b"})

    question = [{"role": "user", "content": "What is the capital of France?"}]

    def ask(model: str = BASE, adapters: list | None = None) -> str:
        extra = {"extra_body": {"adapters": adapters}} if adapters is not None else {}
        answer = client.chat.completions.create(model=model, messages=question, max_tokens=16, temperature=0, **extra)
        return answer.choices[0].message.content

    half_and_half = [{"model": names[0], "scale": 0.5}, {"model": names[1], "scale": 0.5}]
    mixed = ask(adapters=half_and_half)
    assert mixed not in (ask(), ask(names[0]), ask(names[1]))
    assert ask(adapters=[{"model": names[0], "scale": 0}]) == ask()  # scale 0 is the base model
    with pytest.raises(openai.BadRequestError) as refused:  # a mix is asked of its base model
        ask(names[0], adapters=half_and_half)
    assert refused.value.code == "mix_needs_base_model"

    composed = api.post("/fine_tuning/models", json={"parents": half_and_half, "suffix": "composed"})
    assert composed.status_code == 200, composed.text
    name = composed.json()["id"]
    assert ask(name) == mixed  # its first request: published, then loaded on demand
    listed = {model["id"]: model for model in api.get("/models").json()["data"]}
    assert listed[name]["lineage"] == {
        "origin": "composed", "parents": half_and_half, "method": "linear", "rank": 16, "approximation_error": 0.0,
    }
    download = api.get(f"/fine_tuning/models/{name}/adapter")
    assert download.status_code == 200 and download.headers["content-type"] == "application/gzip"
    with tarfile.open(fileobj=io.BytesIO(download.content), mode="r:gz") as tar:
        assert sorted(tar.getnames()) == ["adapter_config.json", "adapter_model.safetensors"]

    # A TIES merge runs on bin/run's worker (the default queue), not in the request.
    queued = api.post("/fine_tuning/models", json={"parents": half_and_half, "suffix": "ties", "method": "ties"})
    assert queued.status_code == 202 and queued.json()["status"] == "queued", queued.text
    composition = queued.headers["Location"].removeprefix("/v1")
    wait_until(lambda: api.get(composition).json()["status"] in ("succeeded", "failed"), 180, "the TIES composition")
    done = api.get(composition).json()
    assert done["status"] == "succeeded", done
    assert ask(done["fine_tuned_model"])  # served on its first request


def test_a_batch_over_the_base_model_two_fine_tunes_and_a_mix_answers_as_live_requests_and_a_webhook_says_so(
    platform, tmp_path
):
    from tests.webhook_receiver import Receiver, _serve

    client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.api_key, max_retries=0)
    api = httpx.Client(
        base_url=f"{platform.url}/v1", headers={"Authorization": f"Bearer {platform.api_key}"}, timeout=120
    )
    names = _uploaded_adapters(api, tmp_path, {2: "batched-a", 9: "batched-b"})
    targets = {
        "base": {"model": BASE}, "a": {"model": names[0]}, "b": {"model": names[1]},
        "mix": {"model": BASE, "adapters": [{"model": names[0], "scale": 0.5}, {"model": names[1], "scale": -0.5}]},
    }
    questions = ["What is the capital of France?", "Name a colour."]
    lines = [
        {"custom_id": f"{label}-{number}", "method": "POST", "url": "/v1/chat/completions",
         "body": {**target, "messages": [{"role": "user", "content": question}], "max_tokens": 12, "temperature": 0}}
        for label, target in targets.items() for number, question in enumerate(questions)
    ]
    lines.append({"custom_id": "tools", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": names[0], "messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": 40, "temperature": 0,
        "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}})
    lines.append({**lines[0], "custom_id": "not-ours", "body": {**lines[0]["body"], "model": f"{BASE}:nobodys"}})

    receiver_context = _serve(Receiver())
    receiver = next(receiver_context)
    try:
        hook = api.post("/webhooks", json={"url": receiver.url, "event_types": ["batch.completed"]})
        assert hook.status_code in (200, 201), hook.text
        too_long = [{**lines[0], "custom_id": "long", "body": {**lines[0]["body"], "messages": [
            {"role": "user", "content": "Tell me more. " * BATCH_QUEUE_TOKENS}]}}]
        over_queue = client.files.create(file=("long.jsonl", jsonl(too_long)), purpose="batch")
        with pytest.raises(openai.BadRequestError) as refused:  # nothing queued: past the batch queue's limit
            client.batches.create(input_file_id=over_queue.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert refused.value.code == "batch_too_large" and "BATCH_QUEUE_TOKENS_PER_ORGANIZATION" in refused.value.message

        batch_input = client.files.create(file=("batch.jsonl", jsonl(lines)), purpose="batch")
        with live_traffic(client):  # the batch's lines give way to it: one at a time beside live requests
            batch = client.batches.create(
                input_file_id=batch_input.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            wait_until(lambda: client.batches.retrieve(batch.id).status in ("completed", "failed"), 300, "the batch")
        assert platform.pool_metric("fineserve_background_waits_total") >= 1
        batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (10, 9, 1)
        output = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
        answered = {line["custom_id"]: line["response"]["body"]["choices"][0]["message"] for line in output}
        for line in lines[:-1]:  # each as a live request answers it (greedy; a forced call's arguments too)
            body = dict(line["body"])
            extra = {"extra_body": {"adapters": body.pop("adapters")}} if "adapters" in body else {}
            live = client.chat.completions.create(**body, **extra).choices[0].message
            batched = answered[line["custom_id"]]
            assert batched["content"] == live.content, line["custom_id"]
            calls = [(call["function"]["name"], call["function"]["arguments"]) for call in batched.get("tool_calls") or []]
            assert calls == [(call.function.name, call.function.arguments) for call in live.tool_calls or []]
        assert answered["tools"]["tool_calls"] and json.loads(answered["tools"]["tool_calls"][0]["function"]["arguments"])
        assert len({message["content"] for message in answered.values()}) > 2  # the models do answer differently
        errors = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
        assert [error["custom_id"] for error in errors] == ["not-ours"]
        wait_until(lambda: receiver.received, 60, "the batch.completed webhook")
        event = client.webhooks.unwrap(
            receiver.received[0].body, receiver.received[0].headers, secret=hook.json()["secret"]
        )
        assert event.type == "batch.completed" and event.data.id == batch.id
    finally:
        next(receiver_context, None)


@contextlib.contextmanager
def live_traffic(client: openai.OpenAI) -> Iterator[None]:
    """Live chat requests of the base model, one after another, until the block ends."""
    stop = threading.Event()

    def chat() -> None:
        while not stop.is_set():
            client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "Hi"}], max_tokens=8)

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(chat)
        try:
            yield
        finally:
            stop.set()
        running.result()  # a live request that failed fails the test


def test_a_dpo_job_created_with_method_trains_on_preference_pairs_and_its_model_answers(platform):
    client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.api_key, max_retries=0)
    pairs = client.files.create(file=("pairs.jsonl", preference_dataset(12)), purpose="fine-tune")
    method = {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.1, "n_epochs": 1, "batch_size": 4}}}
    job = client.fine_tuning.jobs.create(model=BASE, training_file=pairs.id, suffix="preferred", method=method)
    job = wait_for_status(client, job.id, FINISHED, timeout_s=420)
    assert job.status == "succeeded", job.error
    assert job.method.type == "dpo" and job.method.dpo.hyperparameters.beta == 0.1
    metrics = [event.message for event in client.fine_tuning.jobs.list_events(job.id, limit=50).data]
    assert any("reward margin=" in message and "preference accuracy=" in message for message in metrics), metrics
    header = client.files.content(job.result_files[0]).text.splitlines()[0]
    assert header.endswith("reward_margin,preference_accuracy"), header
    answer = client.chat.completions.create(
        model=job.fine_tuned_model, messages=[{"role": "user", "content": "What is 3 plus 3?"}], max_tokens=8
    )
    assert answer.model == f"{job.fine_tuned_model}@r1" and answer.choices[0].message.content


def test_a_model_fine_tuned_again_answers_as_r2_rolls_back_to_r1_and_its_checkpoints_answer(platform):
    client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.api_key, max_retries=0)
    api = httpx.Client(
        base_url=f"{platform.url}/v1", headers={"Authorization": f"Bearer {platform.api_key}"}, timeout=60
    )
    training = client.files.create(file=("train.jsonl", good_dataset(12)), purpose="fine-tune")
    question = [{"role": "user", "content": "What is 2 plus 2?"}]

    def answered_by(model: str) -> str:
        return client.chat.completions.create(model=model, messages=question, max_tokens=4, temperature=0).model

    first = client.fine_tuning.jobs.create(
        model=BASE, training_file=training.id, suffix="revised", hyperparameters={"n_epochs": 2, "batch_size": 12}
    )
    assert wait_for_status(client, first.id, FINISHED, timeout_s=420).status == "succeeded"
    name = f"{BASE}:revised"
    checkpoints = [c.fine_tuned_model_checkpoint for c in client.fine_tuning.jobs.checkpoints.list(first.id).data]
    assert sorted(checkpoints) == [f"{name}:ckpt-step-1", f"{name}:ckpt-step-2"]
    first_epoch = f"{name}:ckpt-step-1"
    assert answered_by(first_epoch) == first_epoch  # the first epoch's adapter, served by its name
    assert answered_by(name) == f"{name}@r1"

    # Fine-tuned again under its own suffix: a new revision of the same name.
    second = client.fine_tuning.jobs.create(
        model=name, training_file=training.id, suffix="revised", hyperparameters={"n_epochs": 1, "batch_size": 12}
    )  # one step: "auto" would train 10 epochs of 12 steps, which this test does not need
    assert wait_for_status(client, second.id, FINISHED, timeout_s=420).status == "succeeded"
    assert answered_by(name) == f"{name}@r2" and answered_by(f"{name}@r1") == f"{name}@r1"
    listed = api.get(f"/fine_tuning/models/{name}/revisions").json()["data"]
    assert [(r["revision"], r["current"], r["fine_tuning_job_id"]) for r in listed] == [
        (2, True, second.id),
        (1, False, first.id),
    ]

    assert api.post(f"/fine_tuning/models/{name}/rollback", json={"revision": 1}).json()["revision"] == 1
    assert answered_by(name) == f"{name}@r1"  # the next request
    assert client.models.delete(name).deleted
    time.sleep(1.1)  # another web process may remember the grant for its GRANT_TTL_S
    for gone in (name, f"{name}@r2", first_epoch):
        with pytest.raises(openai.NotFoundError):
            answered_by(gone)


def test_one_eval_call_compares_the_base_model_a_fine_tune_its_r1_and_a_checkpoint_and_the_fine_tune_wins(platform):
    # Then an eval written as OpenAI's guide writes it, and graders.run/validate (judged_as_the_guide_writes_it).
    client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.api_key, max_retries=0)
    training = client.files.create(file=("pirate.jsonl", good_dataset(12)), purpose="fine-tune")
    strong = {"n_epochs": 8, "batch_size": 12, "learning_rate_multiplier": 10}  # 8 steps that learn the pirate's "ARR!"
    job = client.fine_tuning.jobs.create(model=BASE, training_file=training.id, suffix="judged", hyperparameters=strong)
    job = wait_for_status(client, job.id, FINISHED, timeout_s=420)
    assert job.status == "succeeded", job.error
    name = job.fine_tuned_model
    checkpoint = client.fine_tuning.jobs.checkpoints.list(job.id).data[-1].fine_tuned_model_checkpoint  # the oldest

    held_out = jsonl([chat_example(f"What is {i} plus {i}?", f"ARR! {2 * i}, matey.") for i in range(20, 30)])
    evaluation = client.evals.create(
        name="pirate", data_source_config={"type": "custom", "item_schema": {"type": "object"}},
        testing_criteria=[{"type": "string_check", "name": "pirate", "input": "{{sample.output_text}}",
                           "reference": "ARR", "operation": "like"}],
        extra_body={"file": client.files.create(file=("held-out.jsonl", held_out), purpose="fine-tune").id},
    )
    models = [BASE, name, f"{name}@r1", checkpoint]
    first = client.evals.runs.create(
        evaluation.id, data_source={"type": "completions", "model": models[0], "sampling_params": {"max_completion_tokens": 12}},
        extra_body={"models": models[1:]},
    )
    started = first.to_dict()["runs"]
    assert [run["model"] for run in started] == models and started[0]["id"] == first.id

    def finished() -> list:
        runs = [client.evals.runs.retrieve(run["id"], eval_id=evaluation.id) for run in started]
        return runs if all(run.status in ("completed", "failed", "canceled") for run in runs) else []

    wait_until(finished, 300, "the four runs to finish")
    runs = {run.model: run for run in finished()}
    assert all(run.status == "completed" and run.result_counts.total == 10 for run in runs.values()), runs
    passed = {model: runs[model].result_counts.passed for model in models}
    print("ARR-passes of 10:", passed)
    assert passed[name] > passed[BASE] and passed[name] == passed[f"{name}@r1"]  # r1 is what the name serves
    items = client.evals.runs.output_items.list(runs[checkpoint].id, eval_id=evaluation.id, limit=100).data
    assert len(items) == 10 and all(item.sample.output[0].content is not None for item in items)
    assert {item.datasource_item["expected"] for item in items} == {f"ARR! {2 * i}, matey." for i in range(20, 30)}
    judged_as_the_guide_writes_it(client, name)


def judged_as_the_guide_writes_it(client: openai.OpenAI, name: str) -> None:
    """An eval written as OpenAI's evals guide writes one (custom item schema, items inline and then
    as an evals file, a template, graders on item fields, a label_model judged by the base model),
    run for the base model and the fine-tune; then graders.run and graders.validate."""
    item_schema = {"type": "object", "properties": {"question": {"type": "string"}, "answer": {"type": "string"}},
                   "required": ["question", "answer"]}
    items = [{"item": {"question": f"What is {i} plus {i}?", "answer": f"ARR! {2 * i}, matey."}} for i in range(30, 36)]
    evaluation = client.evals.create(
        name="pirate, as the guide", data_source_config={"type": "custom", "item_schema": item_schema, "include_sample_schema": True},
        testing_criteria=[
            {"type": "string_check", "name": "says ARR", "input": "{{sample.output_text}}", "reference": "ARR", "operation": "like"},
            {"type": "text_similarity", "name": "like the answer", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
             "evaluation_metric": "rouge_l", "pass_threshold": 0.3},
            {"type": "label_model", "name": "judge", "model": BASE, "labels": ["pirate", "plain"], "passing_labels": ["pirate"],
             "input": [{"role": "user", "content": "Does this sound like a pirate? {{sample.output_text}}"}]},
        ],
    )
    template = {"type": "template", "template": [{"role": "user", "content": "{{item.question}}"}]}
    sampling = {"temperature": 0, "max_completion_tokens": 12}
    evals_file = client.files.create(file=("pirate-items.jsonl", jsonl(items)), purpose="evals")
    started = [
        client.evals.runs.create(evaluation.id, data_source={"type": "completions", "model": model, "source": source,
                                                              "input_messages": template, "sampling_params": sampling})
        for model, source in ((BASE, {"type": "file_content", "content": items}), (name, {"type": "file_id", "id": evals_file.id}))
    ]

    def finished() -> list:
        runs = [client.evals.runs.retrieve(run.id, eval_id=evaluation.id) for run in started]
        return runs if all(run.status in ("completed", "failed", "canceled") for run in runs) else []

    wait_until(finished, 300, "the guide's two runs to finish")
    base, tuned = finished()
    assert base.status == tuned.status == "completed", (base.error, tuned.error)
    passes = [{r.testing_criteria: r.passed for r in run.per_testing_criteria_results} for run in (base, tuned)]
    print("the guide's eval, passes of 6 (base, fine-tune):", passes)
    assert passes[1]["says ARR"] > passes[0]["says ARR"] and passes[1]["like the answer"] > passes[0]["like the answer"]
    item = client.evals.runs.output_items.list(tuned.id, eval_id=evaluation.id, limit=1).data[0]
    judge = next(result for result in item.results if result.name == "judge")
    assert judge.sample["label"] in ("pirate", "plain")  # the base model judged, under structured outputs

    graded = client.fine_tuning.alpha.graders.run(
        grader={"type": "text_similarity", "name": "close", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
                "evaluation_metric": "fuzzy_match"},
        model_sample="ARR! 60, matey.", item={"answer": "ARR! 60, matey."},
    )
    assert graded.reward == 1.0
    with pytest.raises(openai.BadRequestError) as refused:
        client.fine_tuning.alpha.graders.validate(grader={"type": "string_check", "name": "x", "input": "a", "reference": "b", "operation": "sounds_like"})
    assert refused.value.body["param"] == "grader.operation"


def test_usage_reports_the_completions_served_and_the_tokens_trained_in_the_api_and_the_dashboard(platform, page):
    client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.api_key, max_retries=0)
    api = httpx.Client(
        base_url=f"{platform.url}/v1", headers={"Authorization": f"Bearer {platform.api_key}"}, timeout=60
    )
    today = int(time.time()) // 86400 * 86400

    def base_model_usage() -> tuple[int, int, int]:
        params = {"start_time": today, "group_by": "model", "models": BASE}
        results = [
            r for b in api.get("/organization/usage/completions", params=params).json()["data"] for r in b["results"]
        ]
        return tuple(sum(r[name] for r in results) for name in ("num_model_requests", "input_tokens", "output_tokens"))

    time.sleep(6)  # the web process writes what it counted every 5 s: the earlier tests' usage is in by now
    requests, prompt, completion = base_model_usage()
    answers = [
        client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0)
        for _ in range(2)
    ]
    expected = (
        requests + 2, prompt + sum(a.usage.prompt_tokens for a in answers), completion + sum(a.usage.completion_tokens for a in answers)
    )
    wait_until(lambda: base_model_usage() == expected, 20, "the two completions in the usage API")
    assert client.models.retrieve(BASE).serving == {"state": "loaded", "replicas": 1}  # bin/run's catalog: always on

    trained = api.get("/organization/usage/fine_tuning", params={"start_time": today, "group_by": "model"}).json()
    by_model = {r["model"]: r for b in trained["data"] for r in b["results"]}
    assert by_model[f"{BASE}:revised"]["num_jobs"] == 2 and by_model[f"{BASE}:revised"]["trained_tokens"] > 0

    platform.sign_in(page)
    page.click("nav >> text=Usage")
    page.wait_for_selector("#usage-chart rect")
    totals = page.inner_text("#usage-totals")
    assert BASE in totals and f"{BASE}:revised" in totals
    screenshot(page, "product-usage")


def test_a_cancelled_jobs_checkpoints_answer_until_the_sweeper_deletes_them_after_the_retention(platform):
    client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.api_key, max_retries=0)
    training = client.files.create(file=("train.jsonl", good_dataset(12)), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model=BASE, training_file=training.id, suffix="abandoned", hyperparameters={"n_epochs": 50, "batch_size": 12}
    )
    wait_until(lambda: client.fine_tuning.jobs.checkpoints.list(job.id).data, 300, "the job's first checkpoint")
    checkpoint = client.fine_tuning.jobs.checkpoints.list(job.id).data[-1].fine_tuned_model_checkpoint
    question = [{"role": "user", "content": "Hi"}]
    answer = client.chat.completions.create(model=checkpoint, messages=question, max_tokens=2)
    assert answer.model == checkpoint  # servable while the job trains
    assert client.fine_tuning.jobs.cancel(job.id).status in ("cancelled", "running")
    assert wait_for_status(client, job.id, FINISHED, timeout_s=120).status == "cancelled"

    wait_until(lambda: not client.fine_tuning.jobs.checkpoints.list(job.id).data, 90, "the sweeper's next pass")
    events = [event.message for event in client.fine_tuning.jobs.list_events(job.id, limit=20).data]
    assert any("checkpoint(s)" in message and "UNPUBLISHED_CHECKPOINTS_DAYS" in message for message in events)
    time.sleep(1.1)  # another web process may remember the grant for its GRANT_TTL_S
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=checkpoint, messages=question, max_tokens=2)


def test_tinkers_quickstart_and_an_rl_loop_run_unchanged_and_their_weights_answer_the_openai_client(platform):
    """The Tinker SDK against bin/run's base URL: the quickstart as its guide writes it (learning rate
    1e-4, six steps; rank 16, the catalog's max_lora_rank, where the SDK's default is 32), then an RL
    loop that raises its reward, whose saved weights are published and answer the openai client."""
    service_client = tinker.ServiceClient(base_url=platform.url, api_key=f"tml-{platform.api_key}")
    try:
        started = time.monotonic()
        training_client = service_client.create_lora_training_client(base_model=BASE, rank=16)
        tokenizer = training_client.get_tokenizer()
        processed_examples = [process_example(ex, tokenizer) for ex in EXAMPLES]
        prompt = types.ModelInput.from_ints(tokenizer.encode("English: coffee break\nPig Latin:"))
        params = types.SamplingParams(max_tokens=20, temperature=0.0, stop=["\n"])
        base = service_client.create_sampling_client(base_model=BASE).sample(prompt=prompt, sampling_params=params, num_samples=1)
        losses = []
        for _ in range(6):
            fwdbwd_future = training_client.forward_backward(processed_examples, "cross_entropy")
            optim_future = training_client.optim_step(types.AdamParams(learning_rate=1e-4))
            losses.append(loss_per_token(fwdbwd_future.result(), processed_examples))
            optim_future.result()
        sampling_client = training_client.save_weights_and_get_sampling_client(name="pig-latin-model")
        result = sampling_client.sample(prompt=prompt, sampling_params=params, num_samples=8).result()
        record_timings(tinker_quickstart_s=time.monotonic() - started)
        assert losses == sorted(losses, reverse=True), losses
        assert {tuple(sequence.tokens) for sequence in result.sequences} != {tuple(base.result().sequences[0].tokens)}

        rl_client = service_client.create_lora_training_client(base_model=BASE, rank=16)
        prompts = [chat_prompt(tokenizer, question) for question in YES_OR_NO]
        rewards = [rl_step(rl_client, rl_client.save_weights_and_get_sampling_client(), tokenizer, prompts, seed) for seed in range(3)]
        assert rewards[-1] > rewards[0], rewards
        path = rl_client.save_weights_for_sampler("product-says-yes").result().path
    finally:
        service_client.close("success").result(timeout=60)
    run_id = path.removeprefix("tinker://").split("/")[0]
    published = httpx.post(
        f"{platform.url}/api/v1/training_runs/{run_id}/checkpoints/sampler_weights/product-says-yes/publish",
        headers={"X-API-Key": f"tml-{platform.api_key}"}, timeout=120,
    )
    assert published.status_code == 200, published.text
    client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.api_key, max_retries=0, timeout=180)
    answer = client.chat.completions.create(
        model=published.json()["model"], messages=[{"role": "user", "content": "Answer yes or no. Is grass green?"}],
        max_tokens=8, temperature=0,
    )
    print(f"\ntinker quickstart losses {[round(loss, 3) for loss in losses]}; RL mean rewards {rewards}; published answers "
          f"{answer.choices[0].message.content!r}")
    assert answer.choices[0].message.content


# Reinforcement fine-tuning, as OpenAI's RFT guide writes it: prompts lines and the field the grader reads.
YES_QUESTIONS = [
    "Is the sky blue on a clear day?", "Is water wet?", "Do fish live in water?", "Is fire hot?", "Is snow cold?",
    "Do birds have feathers?", "Is the sun bright?", "Is grass green?", "Do cats have four legs?", "Is ice frozen water?",
    "Is honey sweet?", "Do trees have leaves?", "Is the ocean salty?", "Do cows give milk?", "Is a lemon sour?",
    "Is the moon round?", "Do dogs bark?", "Is sugar sweet?", "Is rain wet?", "Do bees make honey?", "Is coal black?",
    "Do ducks swim?", "Is milk white?", "Do fish have fins?", "Is a desert dry?", "Do ants work hard?", "Is a rock hard?",
    "Do frogs jump?", "Is lava hot?", "Do owls hoot?", "Is a feather light?", "Do horses run?",
]
SAYS_YES = {
    "type": "text_similarity", "name": "says yes", "evaluation_metric": "fuzzy_match",
    "input": "{{sample.output_text}}", "reference": "{{item.reference_answer}}",
}


def yes_prompts(questions: list[str]) -> bytes:
    return jsonl([{"messages": [{"role": "user", "content": f"{question} Answer yes or no."}], "reference_answer": "Yes"}
                  for question in questions])


def test_a_reinforcement_job_from_the_openai_client_raises_its_reward_and_beats_the_base_model_held_out(platform):
    """The official client creates an RFT job (a text_similarity grader on ``{{item.reference_answer}}``);
    the reward rises, each step's metrics are events, checkpoints answer while it trains; then one
    eval with the same grader, on prompts neither saw, scores the fine-tune above the base model."""
    client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.api_key, max_retries=0, timeout=180)
    training = client.files.create(file=("train.jsonl", yes_prompts(YES_QUESTIONS[:12])), purpose="fine-tune")
    validation = client.files.create(file=("valid.jsonl", yes_prompts(YES_QUESTIONS[12:22])), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model=BASE, training_file=training.id, validation_file=validation.id, suffix="says-yes", seed=3,
        method={"type": "reinforcement", "reinforcement": {"grader": SAYS_YES, "hyperparameters": {
            "n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 5, "eval_interval": 3, "max_completion_tokens": 4,
        }}},
    )
    started = time.monotonic()
    job = wait_for_status(client, job.id, FINISHED, timeout_s=600)
    record_timings(reinforcement_job_s=time.monotonic() - started)
    assert job.status == "succeeded", job.error
    assert job.method.type == "reinforcement" and job.method.reinforcement.grader.name == "says yes"
    events = client.fine_tuning.jobs.list_events(job.id, limit=100).data
    reports = sorted((e.data for e in events if e.type == "metrics" and e.data and "step" in e.data), key=lambda d: d["step"])
    steps = [report for report in reports if report["step"] > 0]
    validations = {report["step"]: report["valid_reward"] for report in reports if "valid_reward" in report}
    print(f"\nRFT rewards {[round(s['reward_mean'], 3) for s in steps]}; validation {validations}; "
          f"samples/s {[round(s['samples_per_second'], 1) for s in steps]}")
    assert [report["step"] for report in steps] == list(range(1, 7)) and sorted(validations) == [0, 3, 6]
    assert steps[-2]["reward_mean"] + steps[-1]["reward_mean"] > steps[0]["reward_mean"] + steps[1]["reward_mean"]
    best_step = max((step for step in validations if step > 0), key=lambda step: validations[step])
    assert validations[best_step] > validations[0]  # the published step beat the base model's answers
    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert sorted(checkpoint.step_number for checkpoint in checkpoints) == [3, 6]
    assert client.files.content(job.result_files[0]).text.startswith("step,epoch,reward_mean,reward_std,pass_rate,valid_reward")

    # The same grader on prompts neither model saw, as an eval (OpenAI's form: with a pass_threshold).
    held_out = [{"item": {"question": f"{question} Answer yes or no.", "reference_answer": "Yes"}} for question in YES_QUESTIONS[22:]]
    evaluation = client.evals.create(
        name="says yes", data_source_config={"type": "custom", "item_schema": {"type": "object"}},
        testing_criteria=[SAYS_YES | {"pass_threshold": 0.5}],
    )
    template = {"type": "template", "template": [{"role": "user", "content": "{{item.question}}"}]}
    sampling = {"temperature": 1.0, "seed": 11, "max_completion_tokens": 4}
    runs = [
        client.evals.runs.create(evaluation.id, data_source={"type": "completions", "model": model, "input_messages": template,
                                                              "source": {"type": "file_content", "content": held_out}, "sampling_params": sampling})
        for model in (BASE, job.fine_tuned_model)
    ]

    scores: list[float] = []  # each run's mean score, once both have finished

    def finished() -> bool:
        done = [client.evals.runs.retrieve(run.id, eval_id=evaluation.id) for run in runs]
        if not all(run.status in ("completed", "failed", "canceled") for run in done):
            return False
        assert all(run.status == "completed" for run in done), [run.error for run in done]
        for run in done:
            found = client.evals.runs.output_items.list(run.id, eval_id=evaluation.id, limit=100).data
            scores.append(sum(item.results[0].score for item in found) / len(found))
        return True

    wait_until(finished, 300, "the held-out eval's two runs")
    base_score, tuned_score = scores
    print(f"held-out mean fuzzy_match to 'Yes': base {base_score:.3f}, fine-tune {tuned_score:.3f}")
    assert tuned_score > base_score


def test_requests_that_once_broke_the_platform_are_refused_with_a_400_that_names_what_is_wrong(platform, tmp_path):
    """The hostile requests that answered 500 (or were stored) on a fresh bin/run, sent to it as a
    stranger would: each is now a 400 in OpenAI's error shape whose message names the problem."""
    api = httpx.Client(
        base_url=f"{platform.url}/v1", headers={"Authorization": f"Bearer {platform.api_key}"}, timeout=60
    )
    chat = '{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], %s}'
    adapter = AdapterMaker(tmp_path)(seed=2)
    config = json.loads((adapter / "adapter_config.json").read_text())
    whole = _archive(adapter)

    def upload(archive: bytes, suffix: str) -> httpx.Response:
        files = {"file": ("adapter.tar.gz", archive)}
        return api.post("/fine_tuning/adapters", files=files, data={"model": BASE, "suffix": suffix})

    def with_config(**changes) -> bytes:
        (tmp_path / "bad").mkdir(exist_ok=True)
        (tmp_path / "bad" / "adapter_config.json").write_text(json.dumps(config | changes))
        (tmp_path / "bad" / "adapter_model.safetensors").write_bytes(
            (adapter / "adapter_model.safetensors").read_bytes()
        )
        return _archive(tmp_path / "bad")

    with_config()  # then its config replaced by JSON nested 100,000 levels deep
    (tmp_path / "bad" / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    nested = _archive(tmp_path / "bad")
    refusals = {
        "max_tokens NaN": api.post("/chat/completions", content=chat % (BASE, '"max_tokens": NaN'),
                                   headers={"Content-Type": "application/json"}),
        "n -Infinity": api.post("/chat/completions", content=chat % (BASE, '"n": -Infinity'),
                                headers={"Content-Type": "application/json"}),
        "start_time of 5,000 digits": api.get("/organization/usage/completions", params={"start_time": "9" * 5000}),
        "a .tar.gz cut in half": upload(whole[: len(whole) // 2], "cut"),
        "a deeply nested adapter_config.json": upload(nested, "nested"),
        "lora_alpha 'x'": upload(with_config(lora_alpha="x"), "alpha"),
    }
    for what, response in refusals.items():
        assert response.status_code == 400, f"{what}: {response.status_code} {response.text[:300]}"
        error = response.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"} and error["message"], f"{what}: {error}"
    listed = {model["id"] for model in api.get("/models").json()["data"]}
    assert not {f"{BASE}:{suffix}" for suffix in ("cut", "nested", "alpha")} & listed  # nothing stored


def test_a_key_past_its_tokens_per_minute_is_refused_with_a_400_alone_and_a_429_with_retry_after_in_a_burst(platform):
    """A request alone over the key's tokens per minute is a 400; a burst within it goes until the
    minute's tokens are spent, then a 429 with Retry-After. Last: it spends the key's minute on purpose."""
    client = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.api_key, max_retries=0)
    hello = [{"role": "user", "content": "Say hi"}]
    with pytest.raises(openai.BadRequestError) as too_large:
        client.chat.completions.create(model=BASE, messages=hello, n=8)  # up to 8 x 2,048 tokens
    assert too_large.value.code == "request_too_large" and "TOKENS_PER_MINUTE_PER_KEY" in too_large.value.message
    answered = 0
    with pytest.raises(openai.RateLimitError) as refused:
        for _ in range(2 * (TOKENS_PER_MINUTE_PER_KEY // 2_000 + 1)):  # twice: the minute may end midway
            # 2,002 tokens charged each, up front; the stop ends the answer within a few tokens: the
            # limit is what is tested, not 2,000 tokens of generation (minutes on a busy CPU).
            client.chat.completions.create(model=BASE, messages=hello, max_tokens=2_000, stop=[" ", "\n", ".", "!"])
            answered += 1
    assert answered >= TOKENS_PER_MINUTE_PER_KEY // 2_002 - 1  # earlier requests may have spent a few tokens of this minute
    assert refused.value.body["type"] == "tokens" and 1 <= int(refused.value.response.headers["Retry-After"]) <= 60
