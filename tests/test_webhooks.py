"""Webhooks: endpoints registered through the API and the dashboard receive each event once, signed
as Standard Webhooks sign (checked here by the standard's algorithm, written again independently),
retried after a failure with the same ``webhook-id``; and nothing is ever sent to an address a
tenant must not reach (SSRF).

The receiver is a real HTTP server on 127.0.0.1, so these tests allow private addresses
(``WEBHOOKS_ALLOW_PRIVATE_ADDRESSES``, on for the test run: ``tests/environment.py``); the SSRF tests
turn the setting off. Most tests play the worker's part in-process (``deliver``), the messages it
would get collected instead of sent; one runs the whole path through the session's Celery worker.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Iterator
from ipaddress import ip_address
from pathlib import Path

import pytest
from django.db import transaction
from django.test import Client

from core import webhook_http
from core.public_addresses import refusal
from evals import run_status
from evals.models import Eval, EvalRun
from finetuning import job_status, publishing
from finetuning.models import File, FineTuningJob, JobStatus
from tests.inference_fixtures import BASE, adapter_store
from tests.personas import Persona
from tests.processes import wait_until
from tests.webhook_receiver import Received, Receiver, _serve
from webhooks.delivery import MAX_ATTEMPTS, RETRY_DELAYS_S, deliver
from webhooks.event_types import EventType
from webhooks.models import DeliveryStatus, WebhookDelivery, WebhookEndpoint, WebhookEvent

pytestmark = pytest.mark.django_db(transaction=True)  # events leave on commit
LONG_AGO = "2000-01-01T00:00:00Z"


# --- the receiver, and the standard's verification written independently --------------------------


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    yield from _serve(Receiver())


@pytest.fixture
def elsewhere() -> Iterator[Receiver]:
    """A second server: where a redirect points."""
    yield from _serve(Receiver())


def verified(secret: str, received: Received, tolerance_s: int = 300) -> dict:
    """The Standard Webhooks check as a receiver writes it: HMAC-SHA256 over "{id}.{timestamp}.{body}"
    with the base64-decoded part of whsec_..., compared with each "v1,<base64>" of the header."""
    assert secret.startswith("whsec_")
    key = base64.b64decode(secret[len("whsec_") :])
    message_id, timestamp = received.headers["webhook-id"], received.headers["webhook-timestamp"]
    assert abs(time.time() - int(timestamp)) <= tolerance_s
    digest = hmac.new(key, f"{message_id}.{timestamp}.".encode() + received.body, hashlib.sha256).digest()
    expected = base64.b64encode(digest).decode()
    given = [part.split(",", 1)[1] for part in received.headers["webhook-signature"].split() if part.startswith("v1,")]
    assert any(hmac.compare_digest(expected, signature) for signature in given), "bad signature"
    return json.loads(received.body)


# --- helpers -----------------------------------------------------------------------------------------


@pytest.fixture
def queued(monkeypatch) -> list[tuple[str, float | None]]:
    """The messages the worker would get: (delivery id, countdown), collected instead of sent."""
    sent: list[tuple[str, float | None]] = []
    monkeypatch.setattr(
        "webhooks.emitting.send", lambda task, delivery_id, countdown_s=None: sent.append((delivery_id, countdown_s))
    )
    return sent


def work_off(sent: list[tuple[str, float | None]], rounds: int = MAX_ATTEMPTS + 2) -> None:
    """Be the worker: run every message, each retry as soon as it is sent (its wait skipped)."""
    for _ in range(rounds):
        pending, sent[:] = list(sent), []
        for delivery_id, countdown in pending:
            if countdown:  # its wait, over
                WebhookDelivery.objects.filter(pk=delivery_id).update(next_attempt_at=LONG_AGO)
            deliver(delivery_id)
        if not sent:
            return


def register(persona: Persona, url: str, **fields: object) -> dict:
    response = persona.api.post("/v1/webhooks", {"url": url, **fields}, format="json")
    assert response.status_code == 200, response.content
    return response.json()


def _training_file(persona: Persona) -> File:
    return File.objects.create(
        organization=persona.organization, filename="train.jsonl", bytes=1, storage_key="test/webhooks",
        example_count=10, token_count=100, max_example_tokens=10,
    )


def _job(persona: Persona, suffix: str, status: str = JobStatus.QUEUED) -> FineTuningJob:
    return FineTuningJob.objects.create(
        organization=persona.organization, model=BASE, training_file=_training_file(persona).id, suffix=suffix, seed=0,
        hyperparameters={"n_epochs": 1, "batch_size": 1, "learning_rate_multiplier": 1.0}, status=status,
        attempts=1 if status == JobStatus.RUNNING else 0,
    )


def _run(persona: Persona) -> EvalRun:
    training = _training_file(persona)
    evaluation = Eval.objects.create(
        organization=persona.organization, name="hooks", file_id=training.id, item_count=10,
        testing_criteria=[{"type": "contains", "name": "contains"}],
    )
    return EvalRun.objects.create(
        eval=evaluation, organization=persona.organization, name="hooks", model=BASE, file_id=training.id,
        sampling={"max_completion_tokens": 8, "temperature": 0.0, "top_p": 1.0, "seed": None}, total_items=10,
    )


def _fake_adapter(folder: Path) -> Path:
    """Files enough for the store to publish (nothing here loads them)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": BASE, "r": 8}))
    (folder / "adapter_model.safetensors").write_bytes(b"not loaded")
    return folder


def every_event(persona: Persona, tmp_path: Path, suffix: str) -> dict[str, str]:
    """Make each event type happen once, from the places the states change; {type: object id}."""
    cancelled = _job(persona, f"{suffix}-cancelled")
    assert persona.api.post(f"/v1/fine_tuning/jobs/{cancelled.id}/cancel").status_code == 200
    failed = _job(persona, f"{suffix}-failed", JobStatus.RUNNING)
    job_status.fail(failed.id, 1, "test", "failed on purpose")
    succeeded = _job(persona, f"{suffix}-ok", JobStatus.RUNNING)
    name = f"{BASE}:{suffix}-ok"
    publishing.write_trained_revision(succeeded, _fake_adapter(tmp_path / suffix))
    assert job_status.succeed(succeeded, 1, name, trained_tokens=10, final_loss=0.5)
    runs = {}
    for outcome in ("succeeded", "failed", "canceled"):
        run = _run(persona)
        assert run_status.claim(run.id, "test-worker")
        if outcome == "succeeded":
            assert run_status.complete(run.id, 10)
        elif outcome == "failed":
            assert run_status.fail(run.id, "test", "failed on purpose")
        else:
            run_status.cancel(run)
        runs[f"eval.run.{outcome}"] = run.id
    return runs | _batch_events(persona) | {
        "fine_tuning.job.cancelled": cancelled.id, "fine_tuning.job.failed": failed.id,
        "fine_tuning.job.succeeded": succeeded.id, "model.ready": name, **runs,
    }


def _batch_events(persona: Persona) -> dict[str, str]:
    """Each batch.* event, from ``batches.batch_status`` (where a batch's status moves)."""
    from datetime import timedelta

    from django.utils import timezone

    from batches import batch_status
    from batches.models import Batch, BatchStatus

    def batch(expires_in: timedelta = timedelta(hours=24)) -> Batch:
        return Batch.objects.create(
            organization=persona.organization, input_file_id="file-x", endpoint="/v1/chat/completions",
            completion_window="24h", expires_at=timezone.now() + expires_in,
        )

    done, failed, expired, cancelled = batch(), batch(), batch(-timedelta(seconds=1)), batch()
    claimed = batch_status.claim(done.pk, "test-worker")
    assert claimed and batch_status.finalize(claimed) and batch_status.finish(claimed, BatchStatus.COMPLETED, None, None)
    assert batch_status.fail(failed.pk, "test", "failed on purpose")
    assert batch_status.expire_waiting(timezone.now()) == [expired.pk]
    batch_status.cancel(cancelled)
    return {
        "batch.completed": done.pk, "batch.failed": failed.pk, "batch.expired": expired.pk, "batch.cancelled": cancelled.pk,
    }


@pytest.fixture
def published_names() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for name in names:
        adapter_store().delete(name)


# --- delivery ----------------------------------------------------------------------------------------


def test_it_delivers_every_event_type_once_signed_and_retries_a_500_with_the_same_webhook_id(
    alice, receiver, queued, tmp_path, published_names
):
    endpoint = register(alice, receiver.url)
    receiver.answers.append((500, {}))  # the very first attempt fails
    expected = every_event(alice, tmp_path, "hooks-inproc")
    published_names.append(expected["model.ready"])
    assert {event for event in EventType.values} == set(expected)
    work_off(queued)

    bodies = [verified(endpoint["secret"], received) for received in receiver.received]
    assert len(receiver.received) == len(expected) + 1  # one retry
    first, retry = (
        receiver.received[0],
        [r for r in receiver.received[1:] if r.headers["webhook-id"] == receiver.received[0].headers["webhook-id"]],
    )
    assert len(retry) == 1 and retry[0].body == first.body  # the same message, the same id, sent again
    delivered = {body["id"]: body for body in bodies}
    assert len(delivered) == len(expected)  # each event once (the 500'd attempt aside)
    assert {body["type"]: body["data"]["id"] for body in delivered.values()} == expected
    for body in delivered.values():
        assert body["object"] == "event" and body["id"].startswith("evt_") and isinstance(body["created_at"], int)
    assert (
        delivered[next(i for i, b in delivered.items() if b["type"] == "model.ready")]["data"]["revision"]
        == f"{expected['model.ready']}@r1"
    )
    assert WebhookDelivery.objects.filter(status=DeliveryStatus.SUCCEEDED).count() == len(expected)


def test_the_official_openai_client_verifies_and_unwraps_a_delivery(alice, receiver, queued):
    from openai import OpenAI

    endpoint = register(alice, receiver.url)
    job = _job(alice, "official")
    job_status.cancel_job(job)
    work_off(queued)
    (received,) = receiver.received
    event = OpenAI(api_key="unused").webhooks.unwrap(received.body, received.headers, secret=endpoint["secret"])
    assert (event.type, event.data.id) == ("fine_tuning.job.cancelled", job.id)


def test_a_delivered_event_is_never_sent_again_whatever_message_comes(alice, receiver, queued):
    register(alice, receiver.url)
    job = _job(alice, "again")
    job_status.cancel_job(job)
    ((delivery_id, _),) = queued
    assert deliver(delivery_id).startswith("attempt 1")
    assert deliver(delivery_id) == "nothing to send"  # a redelivered message
    WebhookDelivery.objects.filter(pk=delivery_id).update(sending_since=None)  # even past any stuck bound
    assert deliver(delivery_id) == "nothing to send"
    assert len(receiver.received) == 1


def test_it_gives_up_after_the_schedule_and_logs_every_attempt(alice, receiver, queued):
    endpoint = register(alice, receiver.url)
    receiver.answers.extend([(503, {})] * MAX_ATTEMPTS)
    job_status.cancel_job(_job(alice, "down"))
    countdowns = []
    for _ in range(MAX_ATTEMPTS):
        ((delivery_id, countdown),) = queued
        countdowns.append(countdown)
        queued.clear()
        WebhookDelivery.objects.filter(pk=delivery_id).update(next_attempt_at=LONG_AGO)
        deliver(delivery_id)
    assert not queued  # no attempt after the last
    assert countdowns == [None, *RETRY_DELAYS_S]
    assert len({r.headers["webhook-id"] for r in receiver.received}) == 1 and len(receiver.received) == MAX_ATTEMPTS
    log = alice.api.get(f"/v1/webhooks/{endpoint['id']}/deliveries").json()["data"]
    assert log[0]["status"] == "failed"
    assert [(a["attempt"], a["status_code"]) for a in log[0]["attempts"]] == [
        (n, 503) for n in range(1, MAX_ATTEMPTS + 1)
    ]
    assert all(a["duration_ms"] >= 0 for a in log[0]["attempts"])


def test_nothing_is_emitted_for_a_change_rolled_back(alice, receiver, queued):
    register(alice, receiver.url)
    job = _job(alice, "rolled-back")
    with pytest.raises(RuntimeError), transaction.atomic():
        job_status.cancel_job(job)
        raise RuntimeError("the surrounding work failed")
    assert FineTuningJob.objects.get(pk=job.pk).status == JobStatus.QUEUED
    assert not queued and not WebhookEvent.objects.exists()


def test_an_endpoint_gets_only_the_types_it_asked_for_and_a_disabled_one_nothing(alice, charlie, receiver, queued):
    only_runs = register(alice, receiver.url, event_types=["eval.run.succeeded"])
    off = register(alice, receiver.url)
    assert alice.api.post(f"/v1/webhooks/{off['id']}", {"enabled": False}, format="json").json()["enabled"] is False
    register(charlie, receiver.url)  # another organization's events are not charlie's
    job_status.cancel_job(_job(alice, "filtered"))
    run = _run(alice)
    run_status.claim(run.id, "w")
    run_status.complete(run.id, 10)
    assert [d.endpoint_id for d in WebhookDelivery.objects.all()] == [only_runs["id"]]
    work_off(queued)
    assert [json.loads(r.body)["type"] for r in receiver.received] == ["eval.run.succeeded"]


def test_the_celery_worker_delivers_each_event_once_after_a_500(
    alice, receiver, celery_worker, tmp_path, published_names
):
    """The whole path: emitted on commit, sent by the session's worker, retried after RETRY_DELAYS_S[0]."""
    endpoint = register(alice, receiver.url)
    receiver.answers.append((500, {}))
    expected = every_event(alice, tmp_path, "hooks-worker")
    published_names.append(expected["model.ready"])
    done = lambda: WebhookDelivery.objects.filter(status=DeliveryStatus.SUCCEEDED).count() == len(expected)  # noqa: E731
    wait_until(done, 60 + RETRY_DELAYS_S[0], "every delivery succeeded", celery_worker.process)
    time.sleep(1)  # a duplicate would come now
    bodies = [verified(endpoint["secret"], received) for received in receiver.received]
    assert len(bodies) == len(expected) + 1
    assert sorted(body["type"] for body in {body["id"]: body for body in bodies}.values()) == sorted(expected)
    assert len({r.headers["webhook-id"] for r in receiver.received}) == len(expected)


# --- SSRF --------------------------------------------------------------------------------------------

NEVER_REACHED = [
    "127.0.0.1", "127.1.2.3", "10.0.0.1", "172.16.5.4", "192.168.1.1", "100.64.0.1", "169.254.169.254", "0.0.0.0",
    "224.0.0.1", "240.0.0.1", "255.255.255.255", "::1", "::", "fe80::1", "fd00::1", "ff02::1", "::ffff:127.0.0.1",
    "::ffff:169.254.169.254", "::ffff:10.0.0.1", "64:ff9b::a9fe:a9fe", "2002:7f00:1::",
]


@pytest.mark.parametrize("address", NEVER_REACHED)
def test_a_private_loopback_metadata_or_special_address_is_refused(address):
    assert refusal(ip_address(address), allow_private=False) is not None


def test_public_addresses_pass_and_the_setting_allows_private_and_loopback_only():
    assert refusal(ip_address("93.184.215.14"), False) is None
    assert refusal(ip_address("2606:4700::1111"), False) is None
    assert refusal(ip_address("::ffff:8.8.8.8"), False) is None
    for allowed in ("127.0.0.1", "10.0.0.1", "::1", "::ffff:192.168.0.1"):
        assert refusal(ip_address(allowed), True) is None
    for still_refused in ("169.254.169.254", "::ffff:169.254.169.254", "fe80::1", "0.0.0.0", "224.0.0.1", "240.0.0.1"):
        assert refusal(ip_address(still_refused), True) is not None


@pytest.mark.parametrize(
    "url",
    [
        "https://127.0.0.1/hook", "https://[::1]/hook", "https://169.254.169.254/latest/meta-data/",
        "https://[::ffff:127.0.0.1]/hook", "https://[::ffff:a9fe:a9fe]/", "https://10.1.2.3/", "https://localhost/",
        "https://0.0.0.0/", "http://example.com/hook", "ftp://example.com/", "https://user:pw@example.com/",
        "https://example.com:99999/", "https://exa mple.com/", "https:///nohost", "https://example.com/#frag",
    ],
)
def test_registration_refuses_a_url_webhooks_must_not_reach_with_a_400(alice, settings, url):
    settings.WEBHOOKS_ALLOW_PRIVATE_ADDRESSES = False
    response = alice.api.post("/v1/webhooks", {"url": url}, format="json")
    assert response.status_code == 400, response.content
    assert response.json()["error"]["param"] == "url"
    assert not WebhookEndpoint.objects.exists()


def test_the_sender_resolves_and_refuses_a_name_of_a_loopback_address(alice, receiver, queued, settings):
    register(alice, receiver.url.replace("127.0.0.1", "localhost"))
    settings.WEBHOOKS_ALLOW_PRIVATE_ADDRESSES = False  # the operator turned it off since
    outcome = webhook_http.post(
        receiver.url.replace("127.0.0.1", "localhost").replace("http:", "https:"), b"{}", {}, False
    )
    assert outcome.status_code is None and "loopback" in outcome.error
    job_status.cancel_job(_job(alice, "refused"))
    work_off(queued)
    assert not receiver.received
    attempt = WebhookDelivery.objects.get().attempt_log.first()
    assert attempt.status_code is None and attempt.error.startswith("Not sent")


def test_a_redirect_is_not_followed(alice, receiver, elsewhere, queued):
    metadata = "http://169.254.169.254/latest/meta-data/"
    receiver.answers.extend([(302, {"Location": elsewhere.url}), (307, {"Location": metadata})])
    register(alice, receiver.url)
    job_status.cancel_job(_job(alice, "redirected"))
    ((delivery_id, _),) = queued
    queued.clear()
    deliver(delivery_id)
    WebhookDelivery.objects.filter(pk=delivery_id).update(next_attempt_at=LONG_AGO)
    deliver(delivery_id)
    assert not elsewhere.received
    assert [a.status_code for a in WebhookDelivery.objects.get().attempt_log.all()] == [302, 307]


def test_it_connects_to_the_address_it_checked_without_resolving_again(alice, receiver, queued, monkeypatch):
    """A name that does not resolve anywhere but in our resolver: the connection uses the checked address."""
    lookups = []

    def resolve(host: str, port: int):
        lookups.append(host)
        return [ip_address("127.0.0.1")]

    monkeypatch.setattr(webhook_http, "resolve", resolve)
    register(alice, receiver.url.replace("127.0.0.1", "hooks.example.test"))
    job_status.cancel_job(_job(alice, "pinned"))
    work_off(queued)
    assert lookups == ["hooks.example.test"]
    assert receiver.received[0].host.startswith("hooks.example.test:")


def test_a_receiver_that_never_answers_is_cut_off_at_the_deadline(monkeypatch):
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)  # accepts (the kernel does), never answers
    monkeypatch.setattr(webhook_http, "CONNECT_TIMEOUT_S", 0.5)
    try:
        outcome = webhook_http.post(f"http://127.0.0.1:{listener.getsockname()[1]}/", b"{}", {}, True)
    finally:
        listener.close()
    assert outcome.status_code is None and "Timed out" in outcome.error and outcome.duration_ms < 5000


# --- the API and the dashboard -----------------------------------------------------------------------


def test_the_api_shows_the_secret_once_and_keeps_other_organizations_out(alice, bob, charlie, receiver):
    created = register(alice, receiver.url, description="CI", event_types=["fine_tuning.job.succeeded", "model.ready"])
    assert created["secret"].startswith("whsec_") and len(base64.b64decode(created["secret"][6:])) == 32
    fetched = bob.api.get(f"/v1/webhooks/{created['id']}").json()
    assert "secret" not in fetched and fetched["event_types"] == ["fine_tuning.job.succeeded", "model.ready"]
    assert [e["id"] for e in alice.api.get("/v1/webhooks").json()["data"]] == [created["id"]]
    for method, path in (("get", ""), ("post", ""), ("delete", ""), ("get", "/deliveries")):
        response = getattr(charlie.api, method)(
            f"/v1/webhooks/{created['id']}{path}", {"enabled": False}, format="json"
        )
        assert response.status_code == 404, (method, path)
    assert charlie.api.get("/v1/webhooks").json()["data"] == []
    updated = alice.api.post(
        f"/v1/webhooks/{created['id']}", {"event_types": [], "enabled": False}, format="json"
    ).json()
    assert (updated["event_types"], updated["enabled"]) == ([], False)
    assert alice.api.delete(f"/v1/webhooks/{created['id']}").json()["deleted"] is True
    assert not WebhookEndpoint.objects.exists()


def test_the_api_refuses_an_unknown_event_type_naming_the_known_ones(alice, receiver):
    response = alice.api.post("/v1/webhooks", {"url": receiver.url, "event_types": ["batch.exploded"]}, format="json")
    assert response.status_code == 400
    assert "fine_tuning.job.succeeded" in response.json()["error"]["message"]


def test_the_dashboard_registers_shows_the_log_and_deletes(alice, receiver, queued):
    browser = Client()
    browser.force_login(alice.user)
    page = browser.post("/webhooks", {"url": receiver.url, "event_types": ["fine_tuning.job.cancelled"]})
    endpoint = WebhookEndpoint.objects.get()
    assert page.status_code == 200 and endpoint.secret in page.content.decode()  # shown once
    assert endpoint.secret not in browser.get("/webhooks").content.decode()
    receiver.answers.append((500, {}))
    job_status.cancel_job(_job(alice, "dashboard"))
    work_off(queued)
    log = browser.get(f"/webhooks/{endpoint.id}").content.decode()
    assert "fine_tuning.job.cancelled" in log and "HTTP 500" in log and "HTTP 200" in log
    refused = browser.post("/webhooks", {"url": "https://169.254.169.254/"})
    assert 'role="alert"' in refused.content.decode() and WebhookEndpoint.objects.count() == 1
    assert browser.post(f"/webhooks/{endpoint.id}/enabled", {}).status_code == 302
    assert WebhookEndpoint.objects.get().enabled is False
    assert browser.post(f"/webhooks/{endpoint.id}/delete").status_code == 302
    assert not WebhookEndpoint.objects.exists()
