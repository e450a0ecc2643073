# ruff: noqa: F811 (pytest fixtures are imported from tests.dead_pool, then named as arguments)
"""The gateway's own decisions (keys, models, errors), through both of its entry points, no engine.

The fast path (``gateway.asgi``, what the web server runs) and the Django views (what WSGI and
Django's test client reach) share one handler; both are checked. The pool is not running here:
a request the gateway accepts ends in a 503 from the unreachable pool.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.dead_pool import keys, web  # noqa: F401 (fixtures)
from tests.helpers import anyio_backend  # noqa: F401 (a fixture)
from tests.inference_fixtures import BASE, monitoring_headers, register_fine_tuned_model

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.anyio]


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


async def test_it_answers_401_without_a_key_or_with_a_wrong_one(web, keys):
    missing = await web.post("/v1/chat/completions", json=_chat(BASE))
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
    wrong = await web.post("/v1/completions", json={"model": BASE, "prompt": "hi"}, headers=_bearer("sk-wrong"))
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    broken_body = await web.post("/v1/chat/completions", content=b"{", headers=_bearer("sk-wrong"))
    assert broken_body.status_code == 401  # the key is checked before the body


class PoolMetrics:
    """A stand-in for the pool's /metrics (or Ray Serve's): one fine-tuned model's counter, for the
    internal token only."""

    SECRET_MODEL = f"{BASE}:alices-unreleased-bot"

    def __init__(self, token: str, model: str = SECRET_MODEL):
        self.token, self.model, self.authorizations = token, model, []

    async def answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lines = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
        headers = {name.lower(): value for name, _, value in (line.partition(": ") for line in lines[1:])}
        authorization = headers.get("authorization", "")
        self.authorizations.append(authorization)
        if authorization == f"Bearer {self.token}":
            body = (
                "# HELP fineserve_inference_requests_total Completion requests by model and outcome\n"
                "# TYPE fineserve_inference_requests_total counter\n"
                f'fineserve_inference_requests_total{{model="{self.model}"}} 3.0\n'
            ).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        else:
            writer.write(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()
        writer.close()


async def test_it_shows_metrics_only_to_the_monitoring_token_and_names_no_model_without_it(web, keys, settings):
    pool = PoolMetrics(settings.INTERNAL_TOKEN)
    server = await asyncio.start_server(pool.answer, "127.0.0.1", 0)
    settings.INFERENCE_POOL_URL = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        for headers, code in (({}, "missing_internal_token"), (_bearer(keys["alice"]), "invalid_internal_token")):
            refused = await web.get("/metrics", headers=headers)  # an API key is not enough
            assert refused.status_code == 401 and refused.json()["error"]["code"] == code
            assert "fineserve" not in refused.text and BASE not in refused.text
        assert pool.authorizations == []  # refused before the pool was asked
        scraped = await web.get("/metrics", headers=monitoring_headers())
    finally:
        server.close()
    assert scraped.status_code == 200 and "fineserve_gateway_requests_total" in scraped.text
    assert PoolMetrics.SECRET_MODEL in scraped.text  # the web asked the pool with the internal token


async def test_it_keeps_metrics_readable_when_the_pool_refuses_the_webs_token(web, settings):
    pool = PoolMetrics("x" * 64)  # a pool started with another INTERNAL_TOKEN (or SECRET_KEY)
    server = await asyncio.start_server(pool.answer, "127.0.0.1", 0)
    settings.INFERENCE_POOL_URL = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        scraped = await web.get("/metrics", headers=monitoring_headers())
    finally:
        server.close()
    assert scraped.status_code == 200 and "fineserve_gateway_requests_total" in scraped.text
    assert "# the inference pool's metrics are unavailable" in scraped.text and "401" in scraped.text


async def test_it_joins_the_pools_and_ray_serves_metrics_and_says_when_one_has_none(web, settings):
    from dataclasses import replace

    from core.catalog import Catalog

    embedded = settings.MODEL_CATALOG.get(BASE)
    settings.MODEL_CATALOG = Catalog((embedded, replace(embedded, id="ray-model", backend="ray")))
    pool, ray = PoolMetrics(settings.INTERNAL_TOKEN), PoolMetrics(settings.INTERNAL_TOKEN, "ray-model:bot")
    servers = [await asyncio.start_server(backend.answer, "127.0.0.1", 0) for backend in (pool, ray)]
    settings.INFERENCE_POOL_URL, settings.RAY_SERVE_URL = (
        f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}" for server in servers
    )
    try:
        both = (await web.get("/metrics", headers=monitoring_headers())).text
        servers[1].close()
        await servers[1].wait_closed()
        without_ray = await web.get("/metrics", headers=monitoring_headers())
    finally:
        servers[0].close()
    assert PoolMetrics.SECRET_MODEL in both and 'model="ray-model:bot"' in both
    assert both.count("# TYPE fineserve_inference_requests_total counter") == 1  # one family, both backends' samples
    assert without_ray.status_code == 200 and PoolMetrics.SECRET_MODEL in without_ray.text
    assert "# the Ray Serve application's metrics are unavailable" in without_ray.text


async def test_it_answers_404_for_another_organizations_model_and_unknown_ones(web, keys):
    from asgiref.sync import sync_to_async

    from tests.inference_fixtures import Persona

    alices = Persona(keys["alice_org"], keys["alice"], client=None)
    name = await sync_to_async(register_fine_tuned_model)(alices, "private")
    for key, model in ((keys["charlie"], name), (keys["alice"], "gpt-4o"), (keys["alice"], f"{BASE}:missing")):
        response = await web.post("/v1/chat/completions", json=_chat(model), headers=_bearer(key))
        assert response.status_code == 404
        assert response.json() == {
            "error": {
                "message": f"The model `{model}` does not exist or you do not have access to it.",
                "type": "invalid_request_error", "param": "model", "code": "model_not_found",
            }
        }
    allowed = await web.post("/v1/chat/completions", json=_chat(name), headers=_bearer(keys["alice"]))
    assert allowed.status_code == 503 and allowed.json()["error"]["code"] == "pool_unavailable"
    assert allowed.headers["retry-after"] == "2"


async def test_it_answers_400_for_a_body_without_a_model(web, keys):
    response = await web.post("/v1/chat/completions", json={"messages": []}, headers=_bearer(keys["alice"]))
    error = response.json()["error"]
    assert response.status_code == 400 and error["type"] == "invalid_request_error" and "model" in error["message"]


async def test_it_lists_models_with_owner_and_parent(web, keys):
    from asgiref.sync import sync_to_async

    from tests.inference_fixtures import Persona

    name = await sync_to_async(register_fine_tuned_model)(Persona(keys["alice_org"], keys["alice"], None), "listed")
    alices = (await web.get("/v1/models", headers=_bearer(keys["alice"]))).json()
    assert alices["object"] == "list"
    cards = {card["id"]: card for card in alices["data"]}
    assert cards[BASE]["owned_by"] == "system" and cards[BASE]["parent"] is None
    assert cards[name]["owned_by"] == keys["alice_org"].slug and cards[name]["parent"] == BASE
    charlies = (await web.get("/v1/models", headers=_bearer(keys["charlie"]))).json()
    assert name not in {card["id"] for card in charlies["data"]}
    assert (await web.get(f"/v1/models/{name}", headers=_bearer(keys["charlie"]))).status_code == 404
    assert (await web.get(f"/v1/models/{name}", headers=_bearer(keys["alice"]))).json()["id"] == name


async def test_deleting_a_model_deletes_its_checkpoints_files_and_rows_and_keeps_the_job(web, keys):
    from asgiref.sync import sync_to_async
    from finetuning import storage
    from finetuning.models import Checkpoint, FineTuningJob

    from tests.inference_fixtures import Persona

    def a_model_with_checkpoints() -> tuple[str, FineTuningJob, list[str]]:
        name = register_fine_tuned_model(Persona(keys["alice_org"], keys["alice"], None), "kept-then-gone")
        job = FineTuningJob.objects.get(fine_tuned_model=name)
        keys_written = []
        for step in (5, 10):
            prefix = f"{storage.checkpoints_prefix(job.pk)}attempt-1/step-{step}"
            storage.files().put(f"{prefix}/adapter_model.safetensors", b"weights")
            Checkpoint.objects.create(job=job, step_number=step, epoch=step // 5, metrics={}, storage_key=prefix)
            keys_written.append(f"{prefix}/adapter_model.safetensors")
        return name, job, keys_written

    def stored(key: str) -> bool:
        try:
            storage.files().get(key)
        except KeyError:
            return False
        return True

    name, job, written = await sync_to_async(a_model_with_checkpoints)()
    outsider = await web.delete(f"/v1/models/{name}", headers=_bearer(keys["charlie"]))
    assert outsider.status_code == 404 and all(stored(key) for key in written)  # nothing of alice's went
    response = await web.delete(f"/v1/models/{name}", headers=_bearer(keys["alice"]))
    assert response.status_code == 200 and response.json() == {"id": name, "object": "model", "deleted": True}
    assert not any(stored(key) for key in written)
    assert not await sync_to_async(Checkpoint.objects.filter(job=job).exists)()
    assert await sync_to_async(FineTuningJob.objects.filter(pk=job.pk).exists)()  # the job's record stays
