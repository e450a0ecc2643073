"""What a tenant reads when a part behind the gateway fails: what happened and a request id, never
the platform's addresses, file paths or an upstream's raw text. The log keeps the detail under the
same request id. A vLLM refusal of the tenant's own fields still reaches the tenant, paths and
addresses taken out.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re

import httpx
import pytest

from tests.fake_pool import FakeVllm, PoolUnderTest
from tests.inference_fixtures import BASE

pytestmark = pytest.mark.django_db(transaction=True)  # the gateway reads keys on threads of its own

REQUEST_ID = re.compile(r"req_[0-9a-f]{16,}")
INTERNAL = re.compile(r"https?://|127\.0\.0\.1|10\.1\.2\.3|replica-\d|/opt/|/srv/|\.py\b")


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _request_id(message: str) -> str:
    found = REQUEST_ID.search(message)
    assert found, f"no request id in {message!r}"
    return found.group()


def _logged_under(caplog, request_id: str) -> str:
    lines = [record.getMessage() for record in caplog.records if request_id in record.getMessage()]
    assert lines, f"nothing logged under {request_id}"
    return "\n".join(lines)


def test_a_pool_that_is_down_answers_503_naming_no_address_and_the_log_has_it(alice, settings, caplog):
    settings.INFERENCE_POOL_URL = "http://127.0.0.1:9"  # the discard port: nothing listens
    caplog.set_level(logging.WARNING)
    body = {"model": BASE, "messages": [{"role": "user", "content": "hi"}]}
    response = alice.api.post("/v1/chat/completions", body, format="json")
    error = response.json()["error"]
    assert response.status_code == 503 and error["code"] == "pool_unavailable" and response["Retry-After"]
    assert not INTERNAL.search(error["message"]), error["message"]
    assert "127.0.0.1:9" in _logged_under(caplog, _request_id(error["message"]))


class FailingVllm(FakeVllm):
    """A replica whose completions fail with ``status`` and ``message``, as vLLM writes its errors."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__()
        self.status, self.message, self.param = status, message, param

    def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("completions"):
            error = {"message": self.message, "type": "BadRequestError", "param": self.param, "code": self.status}
            return httpx.Response(self.status, json={"error": error})
        return super().handler(request)


def _pool_with(tmp_path, vllm: FakeVllm) -> PoolUnderTest:
    pool = PoolUnderTest(tmp_path, replicas=1)
    pool.vllm = vllm
    pool.client._transport = httpx.MockTransport(vllm.handler)  # the admin client and the completions poster
    return pool


@pytest.mark.anyio
async def test_a_vllm_refusal_of_the_tenants_field_reaches_the_tenant_without_paths_or_addresses(tmp_path):
    said = (
        "1 validation error for ChatCompletionRequest: top_k: Input should be a valid integer, got 'many' "
        "[see /opt/venv/lib/python3.11/site-packages/vllm/entrypoints/openai/protocol.py, or "
        "http://10.1.2.3:8001/docs]"
    )
    pool = _pool_with(tmp_path, FailingVllm(400, said, param="top_k"))
    response = await pool.chat(BASE)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "top_k"
    assert "top_k: Input should be a valid integer, got 'many'" in error["message"]  # what the tenant needs
    assert not INTERNAL.search(error["message"]), error["message"]


@pytest.mark.anyio
async def test_a_vllm_server_error_is_a_502_with_a_request_id_and_the_log_keeps_its_text(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    said = 'Traceback: File "/opt/venv/lib/python3.11/site-packages/vllm/engine.py", line 9: RuntimeError: boom'
    pool = _pool_with(tmp_path, FailingVllm(500, said))
    response = await pool.chat(BASE)
    error = response.json()["error"]
    assert response.status_code == 502 and error["code"] == "replica_error"
    assert not INTERNAL.search(error["message"]) and "RuntimeError" not in error["message"], error["message"]
    assert "RuntimeError: boom" in _logged_under(caplog, _request_id(error["message"]))


@pytest.mark.anyio
async def test_a_replica_lost_mid_request_names_no_replica(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    pool = PoolUnderTest(tmp_path, replicas=1)
    pool.vllm.dies_mid_request.add("http://replica-0")
    response = await pool.chat(BASE)
    error = response.json()["error"]
    assert response.status_code == 503 and error["code"] == "replica_unavailable"
    assert "not sent again" in error["message"] and not INTERNAL.search(error["message"]), error["message"]
    assert "Server disconnected" in _logged_under(caplog, _request_id(error["message"]))


def test_an_adapter_store_that_does_not_answer_names_no_endpoint(caplog):
    from core import api_errors

    caplog.set_level(logging.WARNING)
    detail = "Could not connect to the endpoint URL: http://127.0.0.1:9000/bucket/adapters/x (/srv/cache)"
    for error in (
        api_errors.adapter_store_unreachable(f"{BASE}:x", detail),
        api_errors.adapter_store_unavailable(f"{BASE}:x", detail),
    ):
        assert error.status == 503 and f"{BASE}:x" in error.message
        assert not INTERNAL.search(error.message), error.message
        assert "127.0.0.1:9000" in _logged_under(caplog, _request_id(error.message))


class _VllmAnswerOnRay:
    """A Serve deployment handle whose replica relays a vLLM error, as ``inference.ray_serve.replica`` does."""

    def __init__(self, status: int, body: bytes):
        self.status, self.body = status, body

    def options(self, **_options):
        return self

    @property
    def answer(self):
        return self

    def remote(self, endpoint: str, body: bytes, background: bool, organization: str | None, mix: object = None):
        from inference.ray_serve.replica import STARTED, Head

        return _Answer([STARTED, Head(self.status, "application/json"), self.body])


class _Answer:
    """A Serve streaming response: chunks, and ``cancel``."""

    def __init__(self, chunks: list):
        self.chunks = chunks

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.chunks:
            raise StopAsyncIteration
        return self.chunks.pop(0)

    def cancel(self) -> None:
        pass


@pytest.mark.anyio
async def test_a_vllm_refusal_relayed_by_ray_serve_is_scrubbed_as_the_pools_are(tmp_path):
    from core.api_errors import ApiError
    from inference.ray_serve.ingress import Ingress, Turn
    from tests.fake_pool import _base_model

    said = {
        "message": "top_k must be -1 or at least 1, got 0 (/opt/vllm/sampling_params.py)",
        "param": "top_k",
        "code": 400,
    }
    answer = _VllmAnswerOnRay(400, json.dumps({"error": {**said, "type": "BadRequestError"}}).encode())
    model = _base_model(str(tmp_path))
    model = dataclasses.replace(model, autoscaling=dataclasses.replace(model.autoscaling, cold_start_wait_s=5))
    ingress = Ingress({BASE: answer}, (model,), "app")
    with pytest.raises(ApiError) as refused:  # the ingress answers it as any of its refusals
        await ingress._complete(json.dumps({"model": BASE, "messages": []}).encode(), "chat/completions", Turn(False, "org"))
    error = refused.value
    assert error.status == 400 and error.param == "top_k" and "top_k must be -1 or at least 1, got 0" in error.message
    assert not INTERNAL.search(error.message), error.message


def test_a_jobs_failure_names_no_endpoint_or_path_and_the_log_has_them(caplog):
    """A job's ``error.message`` is the tenant's to read, as an API error is."""
    from types import SimpleNamespace

    from core.adapter_store import StoreUnavailable
    from workers.run_job import _explained

    caplog.set_level(logging.WARNING)
    job = SimpleNamespace(pk="ftjob-x", hyperparameters={"n_epochs": 1})
    unreachable = _explained(StoreUnavailable("Could not connect to the endpoint URL: http://127.0.0.1:9000/adapters"), job)
    assert unreachable.code == "storage_unavailable" and not INTERNAL.search(unreachable.message), unreachable.message
    assert "127.0.0.1:9000" in _logged_under(caplog, _request_id(unreachable.message))
    crashed = _explained(ValueError("cannot read /srv/fineserve/data/files/x.bin: truncated"), job)
    assert crashed.code == "training_failed" and "ValueError" in crashed.message and "truncated" in crashed.message
    assert not INTERNAL.search(crashed.message), crashed.message
