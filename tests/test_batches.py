"""The Batch API: input files checked line by line, batches created, read, listed and cancelled through
the API and the official openai client, answered by the worker's code (grouped by model, bad lines to
the error file, counts), and a worker killed mid-batch whose task is delivered again.

The serving backend is a stand-in at the HTTP boundary to the pool (``tests.eval_fixtures``): no
engine starts here. The real engine's batches are the main engineer's ``engine`` tests, and
``benchmarks/batch_bench.py`` times line order against grouped order on the running platform."""

# ruff: noqa: F811 (pytest fixtures are imported from tests.eval_fixtures, then named as arguments)
from __future__ import annotations

import json
from datetime import timedelta

import openai
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone

from batches import batch_status, line_answers
from batches.models import Batch, BatchResult, BatchStatus
from core.batch_input import BatchRequest, check_batch_file
from finetuning import files
from finetuning.models import File
from tests.eval_fixtures import BASE, REFUSED, engine  # noqa: F401 (a fixture)
from tests.inference_fixtures import register_fine_tuned_model
from tests.limits import lower_limits
from usage.models import CompletionUsage
from webhooks.models import WebhookEndpoint, WebhookEvent
from workers import run_batch as worker

pytestmark = pytest.mark.django_db(transaction=True)  # the live server reads the database in its own thread

CHAT_URL = "/v1/chat/completions"
COUNTRIES = ("France", "Germany", "Italy", "Spain", "Japan")


def line(custom_id: str, model: str = BASE, question: str = "What is the capital of France?", **body) -> dict:
    return {
        "custom_id": custom_id, "method": "POST", "url": CHAT_URL,
        "body": {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 8, **body},
    }


def jsonl_of(lines: list) -> bytes:
    return b"".join((item if isinstance(item, bytes) else json.dumps(item).encode()) + b"\n" for item in lines)


def upload(persona, lines: list) -> str:
    upload = SimpleUploadedFile("batch.jsonl", jsonl_of(lines), content_type="application/jsonl")
    return files.upload_file(persona.organization, persona.user, upload, files.BATCH_PURPOSE).id


def create(persona, file_id: str, **extra):
    body = {"input_file_id": file_id, "endpoint": CHAT_URL, "completion_window": "24h", **extra}
    return persona.api.post("/v1/batches", body, format="json")


@pytest.fixture
def queued(monkeypatch) -> list[str]:
    """The batches sent to the batch queue; the test runs them itself (``workers.run_batch.run_batch``)."""
    sent: list[str] = []
    monkeypatch.setattr("batches.creation.send_to_worker", sent.append)
    return sent


@pytest.fixture
def no_waits(monkeypatch):
    monkeypatch.setattr(line_answers, "RETRY_WAIT_S", 0.0)


# -- the input file ------------------------------------------------------------------------------


def test_it_refuses_a_bad_batch_file_naming_each_line(alice):
    bad = [
        line("a"),
        b'{"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "temperature": NaN}}',
        line("a"),  # a duplicate custom_id
        {**line("c"), "url": "/v1/embeddings"},
        {**line("d"), "extra": 1},
        b'{"custom_id": "e", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "seed": 1'
        + b"9" * 5000
        + b"}}",
        {**line("f"), "method": "GET"},
        line("g", stream=True),
        b'{"custom_id": "h", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "top_p": Infinity}}',
        b"[" * 10_000,
        {"custom_id": "i", "method": "POST", "url": CHAT_URL, "body": {"messages": []}},
    ]
    response = alice.api.post("/v1/files", {"file": SimpleUploadedFile("b.jsonl", jsonl_of(bad)), "purpose": "batch"})
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "invalid_file" and error["param"] == "file"
    lines = {item["line"]: item["message"] for item in error["errors"]}
    assert set(lines) == {2, 3, 4, 5, 6, 7, 8, 9, 10, 11}
    assert "NaN" in lines[2] and "also on line 1" in lines[3] and "url" in lines[4] and "extra" in lines[5]
    assert "too long" in lines[6] or "integer" in lines[6]
    assert "method" in lines[7] and "stream" in lines[8] and "infinity" in lines[9].lower() and "nest" in lines[10]
    assert "body.model" in lines[11]
    assert "line 2:" in error["message"]
    assert not files.File.objects.filter(purpose="batch").exists()


def test_it_checks_a_file_with_bounded_memory_and_counts_its_requests():
    assert check_batch_file(b"").problem == "the file is empty"
    assert check_batch_file(jsonl_of([line(str(n)) for n in range(5)])).request_count == 5
    too_long = jsonl_of([line("a"), b'{"custom_id": "' + b"x" * (2 * 1024 * 1024) + b'"}', line("b")])
    checked = check_batch_file(too_long)
    assert [(error.line, "bytes" in error.message) for error in checked.errors] == [(2, True)]
    assert checked.request_count == 2
    assert "not UTF-8" in (check_batch_file(b'{"a": "\xff"}\n').problem or "")


def test_it_refuses_a_fine_tune_file_and_another_organizations_file(alice, charlie, queued):
    from tests.personas import good_dataset

    training = files.upload_file(
        alice.organization, alice.user, SimpleUploadedFile("t.jsonl", good_dataset(12)), files.PURPOSE
    )
    response = create(alice, training.id)
    assert response.status_code == 400 and response.json()["error"]["param"] == "input_file_id"
    theirs = upload(alice, [line("a")])
    response = create(charlie, theirs)
    assert response.status_code == 404 and response.json()["error"]["param"] == "input_file_id"
    response = create(alice, theirs, completion_window="48h")
    assert response.status_code == 400 and "completion_window" in response.json()["error"]["param"]
    assert not Batch.objects.exists() and queued == []


# -- the API -------------------------------------------------------------------------------------


def test_it_creates_retrieves_lists_and_cancels_batches(alice, charlie, queued):
    file_id = upload(alice, [line("a"), line("b")])
    first = create(alice, file_id, metadata={"purpose": "nightly"}).json()
    assert first["object"] == "batch" and first["id"].startswith("batch_") and first["status"] == "validating"
    assert first["request_counts"] == {"total": 2, "completed": 0, "failed": 0}
    assert first["metadata"] == {"purpose": "nightly"} and first["expires_at"] - first["created_at"] == 24 * 3600
    assert queued == [first["id"]]
    second = create(alice, file_id).json()
    listed = alice.api.get("/v1/batches", {"limit": 1}).json()
    assert [b["id"] for b in listed["data"]] == [second["id"]] and listed["has_more"]
    after = alice.api.get("/v1/batches", {"after": second["id"]}).json()
    assert [b["id"] for b in after["data"]] == [first["id"]] and not after["has_more"]
    assert alice.api.get(f"/v1/batches/{first['id']}").json()["status"] == "validating"
    assert charlie.api.get(f"/v1/batches/{first['id']}").status_code == 404
    assert charlie.api.post(f"/v1/batches/{first['id']}/cancel").status_code == 404
    assert charlie.api.get("/v1/batches").json()["data"] == []

    cancelled = alice.api.post(f"/v1/batches/{first['id']}/cancel").json()
    assert cancelled["status"] == "cancelled" and cancelled["cancelled_at"] is not None  # nothing had started
    Batch.objects.filter(pk=second["id"]).update(status=BatchStatus.IN_PROGRESS)
    assert alice.api.post(f"/v1/batches/{second['id']}/cancel").json()["status"] == "cancelling"


def test_an_organizations_batch_queue_is_held_to_its_prompt_tokens_and_frees_as_batches_finish(
    alice, charlie, queued, settings
):
    question = "x" * 400  # about 100 prompt tokens a line (characters / 4), "user" included
    file_id = upload(alice, [line(str(n), question=question) for n in range(10)])
    tokens = File.objects.get(pk=file_id).token_count
    assert 1000 < tokens < 1100
    lower_limits(settings, batch_queue_tokens_per_organization=tokens * 2)

    first, second = create(alice, file_id).json()["id"], create(alice, file_id).json()["id"]
    refused = create(alice, file_id)
    assert refused.status_code == 429 and refused["Retry-After"]
    error = refused.json()["error"]
    assert error["code"] == "batch_queue_full" and "BATCH_QUEUE_TOKENS_PER_ORGANIZATION" in error["message"]
    assert f"{tokens * 2:,}" in error["message"] and Batch.objects.count() == 2 and len(queued) == 2  # nothing written
    assert create(charlie, upload(charlie, [line("c", question=question)])).status_code == 200  # its own queue

    Batch.objects.filter(pk=first).update(status=BatchStatus.COMPLETED)  # a finished batch leaves the queue
    assert create(alice, file_id).status_code == 200
    alice.api.post(f"/v1/batches/{second}/cancel")  # so does a cancelled one
    lower_limits(settings, batch_queue_tokens_per_organization=tokens - 1)
    too_large = create(alice, file_id)
    assert too_large.status_code == 400 and too_large.json()["error"]["param"] == "input_file_id"
    assert "split it" in too_large.json()["error"]["message"]


def test_the_openai_client_runs_a_batch_and_downloads_its_files(alice, live_server, engine, queued, no_waits):
    client = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=alice.key, max_retries=0)
    requests = [line(f"q-{country}", question=f"What is the capital of {country}?") for country in COUNTRIES]
    requests.append(line("too-long", question=REFUSED))
    uploaded = client.files.create(file=("batch.jsonl", jsonl_of(requests)), purpose="batch")
    assert uploaded.purpose == "batch"
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint=CHAT_URL, completion_window="24h", metadata={"run": "client"}
    )
    assert batch.status == "validating" and batch.request_counts.total == 6
    assert worker.run_batch(batch.id, "test-worker") == "completed"

    batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.in_progress_at and batch.finalizing_at and batch.completed_at
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (6, 5, 1)
    assert batch.usage.input_tokens == 50 and batch.usage.output_tokens == 15
    output = [json.loads(text) for text in client.files.content(batch.output_file_id).text.splitlines()]
    assert [item["custom_id"] for item in output] == [f"q-{country}" for country in COUNTRIES]
    assert all(item["id"].startswith("batch_req_") and item["error"] is None for item in output)
    assert output[0]["response"]["status_code"] == 200
    assert output[0]["response"]["body"]["choices"][0]["message"]["content"] == "I do not know."
    errors = [json.loads(text) for text in client.files.content(batch.error_file_id).text.splitlines()]
    assert [(item["custom_id"], item["response"]["status_code"]) for item in errors] == [("too-long", 400)]
    assert "maximum context length" in errors[0]["error"]["message"]
    assert [b.id for b in client.batches.list(limit=5).data] == [batch.id]
    assert client.batches.cancel(batch.id).status == "completed"  # finished: nothing to cancel


# -- the worker ----------------------------------------------------------------------------------


def test_bad_lines_go_to_the_error_file_with_their_custom_id_and_the_batch_goes_on(
    alice, charlie, engine, queued, no_waits
):
    theirs = register_fine_tuned_model(charlie, "globex-secret")
    mine = register_fine_tuned_model(alice, "acme-capitals")
    WebhookEndpoint.objects.create(organization=alice.organization, url="https://example.com/hook", secret="whsec_")
    file_id = upload(alice, [
        line("base"),
        line("theirs", model=theirs),
        line("mine", model=mine),
        line("unknown-field", bogus=1),
        line("too-many-tokens", max_tokens=10**9),
        line("mix", model=BASE, adapters=[{"model": mine, "scale": 0.5}]),
        line("mix-of-theirs", model=BASE, adapters=[{"model": theirs, "scale": 0.5}]),
        line("revision", model=f"{mine}@r1"),
        line("no-such-revision", model=f"{mine}@r9"),
    ])
    batch_id = create(alice, file_id).json()["id"]
    assert worker.run_batch(batch_id, "test-worker") == "completed"

    batch = Batch.objects.get(pk=batch_id)
    assert (batch.total, batch.completed, batch.failed) == (9, 4, 5)
    errors = {row.custom_id: json.loads(row.record) for row in BatchResult.objects.filter(batch=batch, ok=False)}
    assert set(errors) == {"theirs", "unknown-field", "too-many-tokens", "mix-of-theirs", "no-such-revision"}
    assert all(error["response"] is None and error["error"]["code"] for error in errors.values())
    assert errors["theirs"]["error"]["code"] == "model_not_found" and "globex" not in json.dumps(
        errors["theirs"]
    ).replace(theirs, "")
    assert "bogus" in errors["unknown-field"]["error"]["message"]
    assert "max_tokens" in errors["too-many-tokens"]["error"]["message"]
    sent = {body["model"] for body in engine.bodies}
    assert theirs not in sent and f"{mine}@r9" not in sent and len(engine.bodies) == 4
    assert all(body["cache_salt"] for body in engine.bodies)  # the organization's own prefix cache, as live requests
    assert engine.background == [True] * 4  # they yield to live requests in the pool
    usage = CompletionUsage.objects.filter(organization=alice.organization)
    assert {(row.model, row.batch) for row in usage} >= {(BASE, True), (mine, True)}
    assert sum(row.requests for row in usage) == 4 and all(row.batch for row in usage)
    assert list(WebhookEvent.objects.values_list("type", "data")) == [("batch.completed", {"id": batch_id})]
    report = alice.api.get(
        "/v1/organization/usage/completions",
        {"start_time": int(timezone.now().timestamp()) - 3600, "group_by": "batch"},
    ).json()
    assert {result["batch"] for bucket in report["data"] for result in bucket["results"]} == {True}


def test_it_answers_lines_grouped_by_model_each_group_in_line_order(alice, engine, queued, no_waits):
    adapter = register_fine_tuned_model(alice, "grouped")
    lines = [
        line(f"l{n}", model=adapter if n % 2 else BASE, question=f"What is the capital of {COUNTRIES[n % 5]}?")
        for n in range(10)
    ]
    requests = [BatchRequest(n + 1, item["custom_id"], CHAT_URL, item["body"]) for n, item in enumerate(lines)]
    groups = line_answers.in_groups(requests)
    assert [[r.custom_id for r in group] for group in groups] == [
        ["l0", "l2", "l4", "l6", "l8"],
        ["l1", "l3", "l5", "l7", "l9"],
    ]

    batch_id = create(alice, upload(alice, lines)).json()["id"]
    assert worker.run_batch(batch_id, "test-worker") == "completed"
    assert [body["model"] for body in engine.bodies] == [BASE] * 5 + [adapter] * 5  # one adapter's lines together
    output = BatchResult.objects.filter(batch_id=batch_id).order_by("line").values_list("custom_id", flat=True)
    assert list(output) == [f"l{n}" for n in range(10)]  # the files keep the input's line order


class Killed(BaseException):
    """The worker process dying: nothing of the task's code runs after it (no ``except Exception``)."""


def test_a_worker_killed_mid_batch_is_delivered_again_and_answers_every_line_exactly_once(
    alice, engine, queued, monkeypatch, no_waits
):
    lines = [line(f"r{n}", question=f"What is the capital of {COUNTRIES[n % 5]}?") for n in range(20)]
    batch_id = create(alice, upload(alice, lines)).json()["id"]
    original, calls = line_answers.answered, []

    def dies_on_the_third_group(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise Killed()
        return original(*args, **kwargs)

    monkeypatch.setattr(line_answers, "answered", dies_on_the_third_group)
    with pytest.raises(Killed):
        worker.run_batch(batch_id, "worker-1")
    batch = Batch.objects.get(pk=batch_id)
    assert batch.status == "in_progress" and batch.completed == 2 * worker.LINES_AT_ONCE
    assert (
        worker.run_batch(batch_id, "worker-2") == f"nothing claimed for {batch_id} (it runs elsewhere or has finished)"
    )

    # The sweeper finds its heartbeat stale and sends it again; another worker goes on from there.
    Batch.objects.filter(pk=batch_id).update(heartbeat_at=timezone.now() - 2 * batch_status.STALE_AFTER)
    assert batch_status.stale() == [batch_id]
    monkeypatch.setattr(line_answers, "answered", original)
    assert worker.run_batch(batch_id, "worker-2") == "completed"

    batch = Batch.objects.get(pk=batch_id)
    assert (batch.completed, batch.failed, batch.attempt) == (20, 0, 2)
    assert len(engine.bodies) == 20  # no line asked twice: the killed group had not been sent
    output = [
        json.loads(text)
        for text in files.open_content(files.File.objects.get(pk=batch.output_file_id)).read().splitlines()
    ]
    assert sorted(item["custom_id"] for item in output) == sorted(f"r{n}" for n in range(20))
    assert len({item["id"] for item in output}) == 20


def test_a_fenced_off_worker_writes_nothing_and_a_cancel_stops_at_the_next_line_boundary(
    alice, engine, queued, no_waits
):
    lines = [line(f"c{n}") for n in range(20)]
    batch_id = create(alice, upload(alice, lines)).json()["id"]
    first = batch_status.claim(batch_id, "worker-1")
    assert first is not None
    Batch.objects.filter(pk=batch_id).update(heartbeat_at=timezone.now() - timedelta(hours=1))
    second = batch_status.claim(batch_id, "worker-2")
    assert second is not None and second.attempt == first.attempt + 1
    assert batch_status.record(first, []) is None  # the first worker lost it: its writes go nowhere

    original = line_answers.answered

    def cancelled_after_the_first_group(*args, **kwargs):
        results = original(*args, **kwargs)
        batch_status.cancel(Batch.objects.get(pk=batch_id))
        return results

    line_answers.answered = cancelled_after_the_first_group  # type: ignore[assignment]
    try:
        Batch.objects.filter(pk=batch_id).update(heartbeat_at=timezone.now() - timedelta(hours=1))
        assert worker.run_batch(batch_id, "worker-3") == "cancelled"
    finally:
        line_answers.answered = original  # type: ignore[assignment]
    batch = Batch.objects.get(pk=batch_id)
    assert batch.status == "cancelled" and batch.completed == worker.LINES_AT_ONCE and batch.output_file_id
    assert batch.cancelling_at and batch.cancelled_at


def test_a_batch_past_its_window_expires_and_a_deleted_file_fails_it(alice, engine, queued, no_waits):
    waiting = create(alice, upload(alice, [line("w")])).json()["id"]
    Batch.objects.filter(pk=waiting).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert batch_status.expire_waiting(timezone.now()) == [waiting]
    assert Batch.objects.get(pk=waiting).status == "expired"

    file_id = upload(alice, [line("x")])
    gone = create(alice, file_id).json()["id"]
    files.delete_file(files.File.objects.get(pk=file_id))
    assert worker.run_batch(gone, "test-worker") == "failed"
    failed = alice.api.get(f"/v1/batches/{gone}").json()
    assert failed["status"] == "failed" and failed["errors"]["data"][0]["code"] == "file_not_found"


def test_lines_may_ask_for_responses_and_completions_and_are_answered_at_their_own_url(alice, engine, queued, no_waits):
    from openai.types.responses import Response

    mine = register_fine_tuned_model(alice, "many-urls")
    responses_line = {
        "custom_id": "response", "method": "POST", "url": "/v1/responses",
        "body": {"model": mine, "instructions": "Answer in one word.", "input": "What is the capital of France?",
                 "max_output_tokens": 8, "metadata": {"k": "v"}},
    }
    file_id = upload(alice, [
        line("chat", model=mine),
        responses_line,
        {"custom_id": "completion", "method": "POST", "url": "/v1/completions",
         "body": {"model": mine, "prompt": "What is the capital of Italy?", "max_tokens": 8}},
        {**responses_line, "custom_id": "stored", "body": responses_line["body"] | {"store": True}},
        {**responses_line, "custom_id": "too-many-tokens", "body": responses_line["body"] | {"max_output_tokens": 10**9}},
        {**responses_line, "custom_id": "chat-fields", "body": {"model": mine, "messages": []}},
    ])
    batch_id = create(alice, file_id, endpoint="/v1/responses").json()["id"]
    assert worker.run_batch(batch_id, "test-worker") == "completed"

    rows = {row.custom_id: json.loads(row.record) for row in BatchResult.objects.filter(batch_id=batch_id)}
    assert rows["chat"]["response"]["body"]["object"] == "chat.completion"
    response = Response.model_validate(rows["response"]["response"]["body"])
    assert response.output_text == "Paris." and response.status == "completed" and response.metadata == {"k": "v"}
    assert response.model == f"{mine}@r1" and response.usage is not None and response.usage.input_tokens == 10
    assert rows["response"]["response"]["request_id"] == response.id and response.id.startswith("resp_")
    assert rows["completion"]["response"]["body"]["choices"][0]["text"] == "Rome."
    errors = {name: rows[name]["error"] for name in ("stored", "too-many-tokens", "chat-fields")}
    assert all(rows[name]["response"] is None for name in errors)
    assert "'store'" in errors["stored"]["message"] and "'max_output_tokens'" in errors["too-many-tokens"]["message"]
    assert "'messages'" in errors["chat-fields"]["message"]
    sent = [(body["_path"], "messages" in body) for body in engine.bodies]
    assert sorted(sent) == [("/v1/chat/completions", True)] * 2 + [("/v1/completions", False)]
    # The lines are answered at once, in any order: the completion's body has no messages.
    system = next(body for body in engine.bodies if body.get("messages", [{}])[0].get("role") == "system")
    assert system["messages"][0]["content"] == "Answer in one word." and system["max_tokens"] == 8
    batch = Batch.objects.get(pk=batch_id)
    assert (batch.completed, batch.failed, batch.endpoint) == (3, 3, "/v1/responses")
