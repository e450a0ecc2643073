"""Who may reach what: one table of every endpoint and page against every kind of caller.

Each cell is what that caller must get for an object of alice's organization (Acme). An outsider
gets 404 for Acme's objects, never 403 and never the data; a revoked key, a removed member's key
and a deactivated user's key stop working at once, the gateway's grant cache included. The pool
and its replicas answer no API key at all: only the internal token.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from accounts.models import ApiKey, Membership
from accounts.services import create_api_key, revoke_api_key
from batches.models import Batch
from evals.models import Eval, EvalRun, OutputItem
from finetuning import files, job_creation, storage
from finetuning.models import Checkpoint, Composition, File, FineTuningJob, JobStatus
from inference.internal_auth import ReplicaGuard
from tests.adapter_archives import adapter_files, tar_gz
from tests.fake_pool import TOKEN, PoolUnderTest
from tests.inference_fixtures import BASE, adapter_store, make_adapter, publish_fine_tuned_model  # noqa: F401
from tests.inference_fixtures import register_fine_tuned_model
from tests.personas import Persona, batch_lines, good_dataset
from training_loops.models import LoopRun, LoopSession, RunStatus
from webhooks.models import WebhookEndpoint

pytestmark = pytest.mark.django_db(transaction=True)  # the gateway reads the database in other threads

DEAD_POOL = "http://127.0.0.1:9"  # the discard port: an allowed completion ends in a 503
LOGIN = "login"  # a 302 to the sign-in page
COLUMNS = ("owner", "member", "outsider", "no key", "revoked key", "removed member", "deactivated user")

# Expected answers, one per column. REST: the key decides. Dashboard: the session decides (a removed
# member is signed in but belongs to no organization: 403; a deactivated user is signed out).
API = (200, 200, 404, 401, 401, 401, 401)
API_OWN_LIST = (200, 200, 200, 401, 401, 401, 401)  # an outsider lists his own (empty) collection
COMPLETION = (503, 503, 404, 401, 401, 401, 401)
NOT_STORED = (404, 404, 404, 401, 401, 401, 401)  # /v1/responses/{id}: no response is kept, for anyone
PAGE = (200, 200, 404, LOGIN, LOGIN, 403, LOGIN)
PAGE_OWN_LIST = (200, 200, 200, LOGIN, LOGIN, 403, LOGIN)
PAGE_ACTION = (302, 302, 404, LOGIN, LOGIN, 403, LOGIN)
PAGE_OWN_ACTION = (302, 302, 302, LOGIN, LOGIN, 403, LOGIN)  # an outsider uploads into his own organization
# Managing (deleting a model, rolling it back, revoking another's key) is for owners unless an owner
# lets members.
API_OWNER_ONLY = (200, 403, 404, 401, 401, 401, 401)
PAGE_OWNER_ONLY = (302, 403, 404, LOGIN, LOGIN, 403, LOGIN)
PLAYGROUND_CHAT = (503, 503, 404, LOGIN, LOGIN, 403, LOGIN)
SWITCH = (302, 302, 403, LOGIN, LOGIN, 403, LOGIN)  # "not a member of that organization"
OPERATOR_ONLY = (401,) * 7  # an API key is not the monitoring or the internal token
UP_OR_DOWN = (200,) * 7  # /healthz: up or down for anyone, no detail
SLASHED = (301,) * 7  # to the address without the slash, for anyone: it tells nothing of the object

# (surface, method, path, body, expected): {file}, {job}, {model}, {key} (its prefix), {org_id}
# name a fresh object of Acme's, made for the one cell (so a delete does not spoil the next cell);
# {published} is a model whose adapter is stored, {checkpoint} is "<job>/checkpoints/<checkpoint>",
# {composition} a composition queued for a worker; {eval} an eval, {evalrun} "<eval>/runs/<run>" (a
# queued run of it), {evalitem} "<eval>/runs/<run>/output_items/<item>", {webhook} a webhook endpoint,
# {batchfile} a file of batch requests, {batch} a batch of one waiting for a worker.
# The body "adapter" is an adapter archive uploaded under a suffix of its own; a composition (API or
# form) is given a suffix of its own too. An outsider composing names Acme's models: 404; comparing
# an Acme model (on an Acme eval, through the models page's form) too.
ROWS = [
    ("api", "GET", "/v1/files", None, API_OWN_LIST),
    ("api", "POST", "/v1/files", "upload", API_OWN_LIST),
    ("api", "GET", "/v1/files/{file}", None, API),
    ("api", "GET", "/v1/files/{file}/content", None, API),
    ("api", "DELETE", "/v1/files/{file}", None, API),
    ("api", "GET", "/v1/fine_tuning/jobs", None, API_OWN_LIST),
    ("api", "POST", "/v1/fine_tuning/jobs", {"model": BASE, "training_file": "{file}"}, API),
    ("api", "GET", "/v1/fine_tuning/jobs/{job}", None, API),
    ("api", "GET", "/v1/fine_tuning/jobs/{job}/events", None, API),
    ("api", "GET", "/v1/fine_tuning/jobs/{job}/checkpoints", None, API),
    ("api", "POST", "/v1/fine_tuning/jobs/{job}/cancel", None, API),
    ("api", "GET", "/v1/fine_tuning/jobs/{checkpoint}/adapter", None, API),
    ("api", "GET", "/v1/fine_tuning/models/{published}/adapter", None, API),
    ("api", "POST", "/v1/fine_tuning/adapters", "adapter", API_OWN_LIST),
    ("api", "POST", "/v1/fine_tuning/models", {"parents": [{"model": "{published}", "scale": 0.5}]}, API),
    ("api", "GET", "/v1/fine_tuning/compositions", None, API_OWN_LIST),
    ("api", "GET", "/v1/fine_tuning/compositions/{composition}", None, API),
    ("api", "GET", "/v1/fine_tuning/models/{published}/revisions", None, API),
    ("api", "POST", "/v1/fine_tuning/models/{published}/rollback", {"revision": 1}, API_OWNER_ONLY),
    ("api", "GET", "/v1/evals", None, API_OWN_LIST),
    ("api", "POST", "/v1/evals", {"testing_criteria": [{"type": "contains"}], "file": "{file}"}, API),
    ("api", "GET", "/v1/evals/{eval}", None, API),
    ("api", "POST", "/v1/evals/{eval}", {"name": "renamed"}, API),
    ("api", "DELETE", "/v1/evals/{eval}", None, API),
    ("api", "GET", "/v1/evals/{eval}/runs", None, API),
    ("api", "POST", "/v1/evals/{eval}/runs", {"data_source": {"type": "completions", "model": BASE}}, API),
    ("api", "POST", "/v1/evals/{eval}/runs", {"data_source": {"type": "completions", "model": "{model}"}}, API),
    ("api", "GET", "/v1/evals/{evalrun}", None, API),
    ("api", "DELETE", "/v1/evals/{evalrun}", None, API),
    ("api", "POST", "/v1/evals/{evalrun}/cancel", None, API),
    ("api", "GET", "/v1/evals/{evalrun}/output_items", None, API),
    ("api", "GET", "/v1/evals/{evalitem}", None, API),
    ("api", "GET", "/v1/batches", None, API_OWN_LIST),
    ("api", "POST", "/v1/batches", {"input_file_id": "{batchfile}", "endpoint": "/v1/chat/completions", "completion_window": "24h"}, API),
    ("api", "GET", "/v1/batches/{batch}", None, API),
    ("api", "POST", "/v1/batches/{batch}/cancel", None, API),
    ("api", "GET", "/v1/webhooks", None, API_OWN_LIST),
    ("api", "POST", "/v1/webhooks", {"url": "https://example.com/hook"}, API_OWN_LIST),
    ("api", "GET", "/v1/webhooks/{webhook}", None, API),
    ("api", "POST", "/v1/webhooks/{webhook}", {"enabled": False}, API),
    ("api", "DELETE", "/v1/webhooks/{webhook}", None, API),
    ("api", "GET", "/v1/webhooks/{webhook}/deliveries", None, API),
    ("api", "GET", "/v1/models", None, API_OWN_LIST),
    ("api", "GET", "/v1/models/{model}", None, API),
    ("api", "DELETE", "/v1/models/{model}", None, API_OWNER_ONLY),
    ("api", "POST", "/v1/chat/completions", {"model": "{model}", "messages": [{"role": "user", "content": "hi"}]}, COMPLETION),
    ("api", "POST", "/v1/responses", {"model": "{model}", "input": "hi"}, COMPLETION),
    ("api", "POST", "/v1/responses", {"model": BASE, "input": "hi", "adapters": [{"model": "{model}"}]}, COMPLETION),
    ("api", "GET", "/v1/responses/resp_0123456789abcdef", None, NOT_STORED),
    ("api", "DELETE", "/v1/responses/resp_0123456789abcdef", None, NOT_STORED),
    # The Tinker protocol (its key header): {looprun} a training run, {loopsession} a session, {sampler} a
    # run's sampler weights as "<run>/checkpoints/sampler_weights/<name>".
    ("tinker", "GET", "/api/v1/training_runs", None, API_OWN_LIST),
    ("tinker", "GET", "/api/v1/training_runs/{looprun}", None, API),
    ("tinker", "GET", "/api/v1/training_runs/{looprun}/checkpoints", None, API),
    ("tinker", "POST", "/api/v1/create_session", {"tags": []}, API_OWN_LIST),
    ("tinker", "POST", "/api/v1/session_heartbeat", {"session_id": "{loopsession}"}, API),
    ("tinker", "POST", "/api/v1/get_info", {"model_id": "{looprun}"}, API),
    ("tinker", "POST", "/api/v1/optim_step", {"model_id": "{looprun}", "adam_params": {}}, API),
    ("tinker", "POST", "/api/v1/create_sampling_session", {"session_id": "{loopsession}", "base_model": BASE}, API),
    ("api", "GET", "/metrics", None, OPERATOR_ONLY),
    ("api", "GET", "/healthz", None, UP_OR_DOWN),
    ("page", "GET", "/datasets", None, PAGE_OWN_LIST),
    ("page", "GET", "/datasets/{file}", None, PAGE),
    ("page", "POST", "/datasets/{file}/delete", None, PAGE_ACTION),
    ("page", "GET", "/jobs", None, PAGE_OWN_LIST),
    ("page", "GET", "/jobs/new", None, PAGE_OWN_LIST),
    ("page", "GET", "/jobs/{job}", None, PAGE),
    ("page", "GET", "/jobs/{job}/", None, SLASHED),
    ("page", "GET", "/jobs/{job}/progress", None, PAGE),
    ("page", "POST", "/jobs/{job}/cancel", None, PAGE_ACTION),
    ("page", "GET", "/jobs/{checkpoint}/adapter", None, PAGE),
    ("page", "GET", "/models", None, PAGE_OWN_LIST),
    ("page", "POST", "/models/{model}/delete", None, PAGE_OWNER_ONLY),
    ("page", "GET", "/models/{published}/adapter", None, PAGE),
    ("page", "GET", "/models/upload", None, PAGE_OWN_LIST),
    ("page", "POST", "/models/upload", "adapter", PAGE_OWN_ACTION),
    ("page", "GET", "/models/compose", None, PAGE_OWN_LIST),
    ("page", "POST", "/models/compose", {"compose-parents": "{published}"}, PAGE_ACTION),
    ("page", "POST", "/models/{published}/rollback", {"revision": "1"}, PAGE_OWNER_ONLY),
    ("page", "POST", "/models/{model}/compare/base", {"eval": "{eval}"}, PAGE_ACTION),
    ("page", "POST", "/models/{model}/compare/revisions", {"eval": "{eval}"}, PAGE_ACTION),
    ("page", "GET", "/evals", None, PAGE_OWN_LIST),
    ("page", "GET", "/evals/{eval}", None, PAGE),
    ("page", "POST", "/evals/{evalrun}/cancel", None, PAGE_ACTION),
    ("page", "GET", "/batches", None, PAGE_OWN_LIST),
    ("page", "GET", "/batches/{batch}/files/input", None, PAGE),
    ("page", "GET", "/playground", None, PAGE_OWN_LIST),
    ("page", "POST", "/playground/chat", {"model": "{model}", "messages": [{"role": "user", "content": "hi"}]}, PLAYGROUND_CHAT),
    ("page", "GET", "/keys", None, PAGE_OWN_LIST),
    ("page", "POST", "/keys/{key}/revoke", None, PAGE_OWNER_ONLY),
    ("page", "POST", "/organization", {"organization": "{org_id}"}, SWITCH),
    ("page", "GET", "/webhooks", None, PAGE_OWN_LIST),
    ("page", "POST", "/webhooks", {"url": "https://example.com/hook"}, PAGE_OWN_LIST),  # the page again, with the secret
    ("page", "GET", "/webhooks/{webhook}", None, PAGE),
    ("page", "POST", "/webhooks/{webhook}/enabled", None, PAGE_ACTION),
    ("page", "POST", "/webhooks/{webhook}/delete", None, PAGE_ACTION),
    ("pool", "GET", "/health", None, OPERATOR_ONLY),
    ("pool", "GET", "/metrics", None, OPERATOR_ONLY),
    ("pool", "POST", "/v1/chat/completions", {"model": "{model}", "messages": []}, OPERATOR_ONLY),
    ("pool", "POST", "/v1/adapters/preload", {"model": "{model}"}, OPERATOR_ONLY),
    ("replica", "GET", "/v1/models", None, OPERATOR_ONLY),
    ("replica", "POST", "/v1/load_lora_adapter", {"lora_name": "{model}", "lora_path": "/tmp"}, OPERATOR_ONLY),
    ("replica", "GET", "/metrics", None, OPERATOR_ONLY),
]


@dataclass
class Caller:
    column: str
    authorization: str | None  # what goes in the Authorization header (API, gateway, pool, replica)
    browser: Client  # the dashboard session (signed in or not)


class AcmeObjects(dict):
    """``str.format_map`` source: each placeholder makes a fresh object of alice's organization,
    remembered so the leak check can look for every Acme id and model name in other callers' answers."""

    def __init__(self, alice: Persona, adapter: Path):
        super().__init__()
        self.alice, self.adapter, self.numbers, self.secrets = alice, adapter, itertools.count(), set()
        self.published: list[str] = []  # in the dynamic path, which outlives the test database

    def __missing__(self, name: str) -> str:
        alice, n = self.alice, next(self.numbers)
        if name == "file":
            value = files.upload_file(alice.organization, alice.user, _upload(), files.PURPOSE).id
        elif name == "job":
            value = _job(alice, n).id
        elif name == "model":
            value = register_fine_tuned_model(alice, f"acme-secret-{n}")
        elif name == "published":
            value = publish_fine_tuned_model(alice, f"acme-published-{n}", self.adapter)
            self.published.append(value)
        elif name == "checkpoint":
            checkpoint = _checkpoint(_job(alice, n), self.adapter)
            self.secrets |= {checkpoint.job_id, checkpoint.id}
            return f"{checkpoint.job_id}/checkpoints/{checkpoint.id}"
        elif name == "composition":
            value = _composition(alice, n).id
        elif name == "eval":
            value = _eval(alice).id
        elif name in ("evalrun", "evalitem"):
            run = _eval_run(_eval(alice))
            self.secrets |= {run.eval_id, run.id}
            if name == "evalrun":
                return f"{run.eval_id}/runs/{run.id}"
            item = OutputItem.objects.create(run=run, index=0, prompt=[], expected="x", answer="x", results=[], status="pass")
            self.secrets.add(item.id)
            return f"{run.eval_id}/runs/{run.id}/output_items/{item.id}"
        elif name == "webhook":  # not through register: a cell each, past an organization's cap of endpoints
            value = WebhookEndpoint.objects.create(organization=alice.organization, url="https://example.com/hook", secret="whsec_").id
        elif name == "batchfile":
            value = _batch_file(alice).id
        elif name == "batch":
            value = _batch(alice).id
        elif name == "key":
            value = create_api_key(alice.organization, alice.user, f"spare {n}")[0].prefix
        elif name == "org_id":
            return str(alice.organization.pk)
        elif name in ("loopsession", "looprun"):
            session = LoopSession.objects.create(organization=alice.organization)
            run = LoopRun.objects.create(
                id=f"{session.pk}:train:0", session=session, organization=alice.organization, base_model=BASE,
                lora_rank=8, status=RunStatus.RUNNING,
            )
            value = session.pk if name == "loopsession" else run.pk
        else:
            raise KeyError(name)
        if not value.isdigit():  # a number shows up in any page; names and ids are what would leak
            self.secrets.add(value)
        return value  # not stored: the next cell gets its own


def _upload():
    from django.core.files.uploadedfile import SimpleUploadedFile

    return SimpleUploadedFile("train.jsonl", good_dataset(12), content_type="application/jsonl")


def _job(alice: Persona, n: int) -> FineTuningJob:
    training = files.upload_file(alice.organization, alice.user, _upload(), files.PURPOSE)
    return FineTuningJob.objects.create(
        organization=alice.organization, model=BASE, training_file=training.id, suffix=f"acme-job-{n}", seed=0,
        hyperparameters={"n_epochs": 1, "batch_size": 1, "learning_rate_multiplier": 1.0}, status=JobStatus.QUEUED,
    )


def _composition(alice: Persona, n: int) -> Composition:
    """A composition queued for a worker (none runs here)."""
    return Composition.objects.create(
        organization=alice.organization, model=f"{BASE}:acme-composed-{n}", parents=[{"model": f"{BASE}:acme", "scale": 1.0}],
        method="svd", rank=4, density=0.5, seed=0, estimated_bytes=1,
    )


def _eval(alice: Persona) -> Eval:
    training = files.upload_file(alice.organization, alice.user, _upload(), files.PURPOSE)
    return Eval.objects.create(
        organization=alice.organization, name="acme-eval", file_id=training.id, item_count=12,
        testing_criteria=[{"type": "contains", "name": "contains"}],
    )


def _eval_run(evaluation: Eval) -> EvalRun:
    return EvalRun.objects.create(
        eval=evaluation, organization=evaluation.organization, name="acme-run", model=BASE, file_id=evaluation.file_id,
        sampling={"max_completion_tokens": 8, "temperature": 0.0, "top_p": 1.0, "seed": None}, total_items=12,
    )


def _batch_file(alice: Persona) -> File:
    from django.core.files.uploadedfile import SimpleUploadedFile

    upload = SimpleUploadedFile("batch.jsonl", batch_lines(2), content_type="application/jsonl")
    return files.upload_file(alice.organization, alice.user, upload, files.BATCH_PURPOSE)


def _batch(alice: Persona) -> Batch:
    return Batch.objects.create(
        organization=alice.organization, input_file_id=_batch_file(alice).id, endpoint="/v1/chat/completions",
        completion_window="24h", total=2, expires_at=timezone.now() + timedelta(hours=24),
    )


def _checkpoint(job: FineTuningJob, adapter: Path) -> Checkpoint:
    key = f"{storage.checkpoints_prefix(job.pk)}attempt-1/step-1"
    for name, data in adapter_files(adapter).items():
        storage.files().put(f"{key}/{name}", data)
    return Checkpoint.objects.create(job=job, step_number=1, epoch=1, metrics={}, storage_key=key)


def _fill(template, objects: AcmeObjects):
    if isinstance(template, str):
        return template.format_map(objects)
    if isinstance(template, dict):
        return {key: _fill(value, objects) for key, value in template.items()}
    if isinstance(template, list):
        return [_fill(value, objects) for value in template]
    return template


class Doors:
    """The five ways in: the web (REST, gateway, dashboard, the Tinker protocol), the pool, and a replica."""

    def __init__(self, tmp_path, adapter: Path):
        self.pool = PoolUnderTest(tmp_path, replicas=1).app
        self.archive, self.uploads = tar_gz(adapter_files(adapter)), itertools.count()
        self.uploaded: list[str] = []  # in the dynamic path, which outlives the test database

        async def replica_route(scope, receive, send):  # stands in for vLLM behind its guard
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"served"})

        self.replica = ReplicaGuard(replica_route)

    def call(self, surface: str, method: str, path: str, body, caller: Caller):
        headers = {"Authorization": caller.authorization} if caller.authorization else {}
        if surface == "tinker":  # the Tinker SDK's header, with the prefix it insists on
            headers = {"X-API-Key": f"tml-{caller.authorization.removeprefix('Bearer ')}"} if caller.authorization else {}
        if surface in ("pool", "replica"):
            return asyncio.run(self._asgi(self.pool if surface == "pool" else self.replica, method, path, body, headers))
        web = caller.browser if surface == "page" else Client()
        if body == "upload":
            return web.post(path, {"file": _upload(), "purpose": "fine-tune"}, headers=headers)
        if body == "adapter":
            return web.post(path, self._adapter_upload("adapter-" if surface == "page" else ""), headers=headers)
        if surface == "page" and (path in ("/organization", "/webhooks") or path.endswith(("/compare/base", "/compare/revisions"))):
            return web.post(path, body, headers=headers)  # forms, as a browser sends them
        if path in ("/v1/fine_tuning/models", "/models/compose") and method == "POST":
            suffix = self._composed_suffix()
            if surface == "page":
                return web.post(path, body | {"compose-suffix": suffix, "compose-method": "linear"}, headers=headers)
            body = body | {"suffix": suffix}
        if body is None:
            return web.generic(method, path, headers=headers)
        return web.generic(method, path, json.dumps(body), content_type="application/json", headers=headers)

    def _adapter_upload(self, prefix: str) -> dict:
        suffix = f"matrix-upload-{next(self.uploads)}"
        self.uploaded.append(f"{BASE}:{suffix}")
        archive = io.BytesIO(self.archive)
        archive.name = "adapter.tar.gz"
        return {f"{prefix}file": archive, f"{prefix}model": BASE, f"{prefix}suffix": suffix}

    def _composed_suffix(self) -> str:
        suffix = f"matrix-composed-{next(self.uploads)}"
        self.uploaded.append(f"{BASE}:{suffix}")
        return suffix

    @staticmethod
    async def _asgi(app, method: str, path: str, body, headers: dict):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://internal") as client:
            return await client.request(method, path, json=body, headers=headers)


def _answer(response) -> int | str:
    status = response.status_code
    if status == 302 and "/login" in response.headers.get("Location", ""):
        return LOGIN
    return status


def _signed_in(user: User | None) -> Client:
    browser = Client()
    if user is not None:
        browser.force_login(user)
    return browser


@pytest.fixture
def adapter(make_adapter) -> Path:  # noqa: F811
    return make_adapter(seed=5)


@pytest.fixture
def doors(tmp_path, settings, monkeypatch, adapter):
    settings.INFERENCE_POOL_URL = DEAD_POOL
    monkeypatch.setattr("health.views.ALL_CHECKS", {})  # /healthz's checks are test_healthz's subject
    monkeypatch.setattr(job_creation, "_send_or_503", lambda job: None)  # no broker: the job stays queued
    monkeypatch.setattr("evals.creation.send_to_worker", lambda run_id: None)  # an eval run too
    monkeypatch.setattr("batches.creation.send_to_worker", lambda batch_id: None)  # a batch too
    monkeypatch.setenv("VLLM_API_KEY", TOKEN)
    doors = Doors(tmp_path, adapter)
    yield doors
    for name in doors.uploaded:
        adapter_store().delete(name)


@pytest.fixture
def objects(alice, adapter):
    objects = AcmeObjects(alice, adapter)
    yield objects
    for name in objects.published:
        adapter_store().delete(name)


def test_every_caller_gets_exactly_its_cell_for_every_endpoint_and_nothing_leaks(alice, bob, charlie, doors, objects):
    revoked, revoked_raw = create_api_key(alice.organization, alice.user, "revoked")
    revoke_api_key(revoked)
    bob_session, alice_session = _signed_in(bob.user), _signed_in(alice.user)
    callers: dict[str, Callable[[], Caller]] = {
        "owner": lambda: Caller("owner", f"Bearer {alice.key}", alice_session),
        "member": lambda: Caller("member", f"Bearer {bob.key}", bob_session),
        "outsider": lambda: Caller("outsider", f"Bearer {charlie.key}", _signed_in(charlie.user)),
        "no key": lambda: Caller("no key", None, _signed_in(None)),
        "revoked key": lambda: Caller("revoked key", f"Bearer {revoked_raw}", _signed_in(None)),
        "removed member": lambda: _withdrawn(doors, objects, bob, bob_session, _remove_membership),
        "deactivated user": lambda: _withdrawn(doors, objects, alice, alice_session, _deactivate),
    }
    surprises, cells = [], 0
    for column_index, column in enumerate(COLUMNS):
        caller = callers[column]()
        for surface, method, template, body, expected in ROWS:
            path, filled = _fill(template, objects), _fill(body, objects)
            response = doors.call(surface, method, path, filled, caller)
            cells += 1
            got, want = _answer(response), expected[column_index]
            if got != want:
                surprises.append(f"{column:16} {surface:7} {method:6} {template}: {got}, expected {want}")
            if column != "owner" and column != "member":
                text = response.content.decode(errors="replace")
                asked = f"{path} {json.dumps(filled)}"  # a 404 may name what the caller asked for
                if leaked := [secret for secret in objects.secrets if secret in text and secret not in asked]:
                    surprises.append(f"LEAK {column} {method} {template}: {leaked}")
            if surface == "api" and template == "/healthz" and "checks" in response.json():
                surprises.append(f"LEAK {column} /healthz shows its checks")
    print(f"\naccess matrix: {len(ROWS)} endpoints x {len(COLUMNS)} callers = {cells} cells, {len(surprises)} surprises")
    assert cells == len(ROWS) * len(COLUMNS)
    assert not surprises, "\n".join(surprises)


def _remove_membership(persona: Persona) -> None:
    Membership.objects.filter(user=persona.user, organization=persona.organization).delete()


def _deactivate(persona: Persona) -> None:
    persona.user.is_active = False
    persona.user.save()


def _withdrawn(doors: Doors, objects: AcmeObjects, persona: Persona, session: Client, withdraw) -> Caller:
    """The persona's key, used a moment ago (so the gateway remembers its grant), then withdrawn:
    the very next request must already be refused."""
    caller = Caller("", f"Bearer {persona.key}", session)
    model = objects["model"]
    warm = doors.call("api", "GET", f"/v1/models/{model}", None, caller)
    assert warm.status_code == 200, warm.content
    withdraw(persona)
    after = doors.call("api", "GET", f"/v1/models/{model}", None, caller)
    assert after.status_code == 401, f"the gateway still grants {persona.user.username}'s key: {after.content!r}"
    return caller


def test_a_key_stops_working_at_once_after_its_revocation_even_through_the_grant_cache(alice, doors):
    spare, raw = create_api_key(alice.organization, alice.user, "spare")
    caller = Caller("owner", f"Bearer {raw}", Client())
    model = register_fine_tuned_model(alice, "cached")
    assert doors.call("api", "GET", f"/v1/models/{model}", None, caller).status_code == 200
    revoke_api_key(ApiKey.objects.get(pk=spare.pk))
    assert doors.call("api", "GET", f"/v1/models/{model}", None, caller).status_code == 401


def test_the_pool_and_a_replica_answer_the_internal_token(doors):
    caller = Caller("platform", f"Bearer {TOKEN}", Client())
    assert doors.call("replica", "GET", "/v1/models", None, caller).status_code == 200
    assert doors.call("pool", "GET", "/metrics", None, caller).status_code == 200
