"""A pool against fake vLLM replicas (no engine), for tests of what the pool asks replicas to do.

The fake speaks vLLM's admin and completion endpoints through httpx.MockTransport; ``PoolUnderTest``
is the pool's own app (``inference.server.create_app``) on replicas that only the fake answers for.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from core.adapter_store import adapter_store
from core.catalog import Autoscaling, BaseModel, Catalog, EngineConfig, LoraConfig
from core.http_client import UpstreamBroken, UpstreamUnavailable
from inference.adapter_source import AdapterSource
from inference.adapters import AdapterManager
from inference.metrics import Metrics
from inference.pool import Pool
from inference.replica import Replica
from inference.server import admin_client, create_app
from tests.inference_fixtures import BASE

TOKEN = "internal-token-for-these-tests-0123456789"
INTERNAL = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class FakeVllm:
    """vLLM's OpenAI server as the pool sees it, for any number of replica URLs."""

    loaded: dict = field(default_factory=dict)  # url -> {name: path}
    down: set = field(default_factory=set)
    dies_mid_request: set = field(default_factory=set)  # urls that take a completion and then vanish
    too_busy_to_probe: set = field(default_factory=set)  # urls whose health check times out
    calls: list = field(default_factory=list)
    max_rank: int = 16
    api_keys: dict = field(default_factory=dict)  # url -> the key it requires, when not TOKEN (--api-key)

    def handler(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.netloc.decode()}"
        if url in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.headers.get("authorization") != f"Bearer {self.api_keys.get(url, TOKEN)}":
            return httpx.Response(401, json={"error": "Unauthorized"})  # as vLLM's --api-key answers
        body = json.loads(request.content or b"{}")
        held = self.loaded.setdefault(url, {})
        path = request.url.path
        if path == "/health":
            if url in self.too_busy_to_probe:
                raise httpx.ReadTimeout("timed out", request=request)
            return httpx.Response(200)
        if path == "/v1/models":  # as vLLM lists them: the base model, then each adapter with its path
            cards = [{"id": BASE, "root": "/weights", "parent": None}]
            cards += [{"id": name, "root": folder, "parent": BASE} for name, folder in held.items()]
            return httpx.Response(200, json={"object": "list", "data": cards})
        self.calls.append((url, path, body.get("lora_name") or body.get("model")))
        if path == "/v1/load_lora_adapter":
            if body["lora_name"] in held:
                return httpx.Response(400, json=_vllm_error("has already been loaded", 400))
            held[body["lora_name"]] = body["lora_path"]
            return httpx.Response(200, text="Success")
        if path == "/v1/unload_lora_adapter":
            if held.pop(body["lora_name"], None) is None:
                return httpx.Response(404, json=_vllm_error("cannot be found", 404))
            return httpx.Response(200, text="Success")
        if path in ("/v1/chat/completions", "/v1/completions"):
            if url in self.dies_mid_request:
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
            model = body["model"]
            if model != BASE and model not in held:
                return httpx.Response(404, json=_vllm_error(f"The model `{model}` does not exist.", 404))
            return httpx.Response(200, json={"model": model, "replica": url, "choices": [], "usage": {}})
        return httpx.Response(404)

    def loads(self, name: str | None = None) -> list:
        return [call for call in self.calls if call[1] == "/v1/load_lora_adapter" and name in (None, call[2])]

    def unloads(self) -> list:
        return [call for call in self.calls if call[1] == "/v1/unload_lora_adapter"]


class HttpxPoster:
    """The pool's hot-path client interface over httpx, so the fake above answers completions too."""

    def __init__(self, client: httpx.AsyncClient):
        self.client = client

    async def post(self, url: str, body: bytes, content_type: str = "application/json") -> BufferedResponse:
        try:
            response = await self.client.post(url, content=body, headers={"content-type": content_type})
        except httpx.ConnectError as exc:
            raise UpstreamUnavailable(str(exc)) from None
        except httpx.TransportError as exc:
            raise UpstreamBroken(str(exc)) from None
        return BufferedResponse(response.status_code, dict(response.headers), response.content)


@dataclass
class BufferedResponse:
    status: int
    headers: dict
    body: bytes

    async def iter_body(self):
        yield self.body

    async def read(self) -> bytes:
        return self.body

    def close(self) -> None:
        pass


async def _settle() -> None:
    """Let the pool's background work (trimming, unloading deleted adapters) run."""
    for _ in range(20):
        await asyncio.sleep(0.01)


def _vllm_error(message: str, code: int) -> dict:
    return {"error": {"message": message, "type": "Error", "param": None, "code": code}}


def _base_model(dynamic_path: str, max_adapters: int = 2) -> BaseModel:
    return BaseModel(
        id=BASE, backend="embedded", weights=Path("unused"), prepare_from=None, replicas=0,
        lora=LoraConfig(dynamic_path, max_adapters, max_lora_rank=16),
        engine=EngineConfig(2048, "float32", 2, 1, ()),
        autoscaling=Autoscaling(min_replicas=0, target_ongoing_requests=16, downscale_delay_s=600, cold_start_wait_s=0),
    )


def _adapter_folder(folder: Path, rank: int = 8, config: str | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(b"weights " + folder.name.encode())
    text = config if config is not None else json.dumps({"r": rank, "base_model_name_or_path": BASE})
    (folder / "adapter_config.json").write_text(text)
    return folder


class PoolUnderTest:
    def __init__(self, tmp_path: Path, replicas: int = 2, max_adapters: int = 2, dynamic: str | None = None, s3=None):
        self.dynamic = dynamic or str(tmp_path / "dynamic")
        self.store = adapter_store(self.dynamic, s3)
        self.tmp = tmp_path
        urls = tuple(f"http://replica-{i}" for i in range(replicas))
        self.model = _base_model(self.dynamic, max_adapters)
        self.pool = Pool(Catalog((self.model,)), first_replica_port=1, internal_token=TOKEN)
        self.pool.replicas = [Replica(self.model, url) for url in urls]  # not started: FakeVllm answers for them
        for replica in self.pool.replicas:
            replica.healthy = True
        self.vllm = FakeVllm()
        self.metrics = Metrics()
        self.client = admin_client(TOKEN, transport=httpx.MockTransport(self.vllm.handler))
        source = AdapterSource(self.store, tmp_path / "cache", self.metrics, BASE)
        self.adapters = AdapterManager({BASE: source}, self.client, self.metrics)
        self.app = create_app(self.pool, self.adapters, HttpxPoster(self.client), self.metrics, TOKEN)
        self.http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://pool", headers=INTERNAL
        )  # as the gateway calls it

    def publish(self, suffix: str, rank: int = 8, config: str | None = None) -> str:
        name = f"{BASE}:{suffix}"
        folder = _adapter_folder(self.tmp / "out" / f"{suffix}-{len(list(self.tmp.glob('out/*')))}", rank, config)
        self.store.publish(name, folder)
        return name

    def served(self, name: str) -> str:
        """The name the replicas hold ``name`` under now: pinned to the revision the store publishes."""
        return f"{name}@{self.store.version(name).version}"

    def loads_of(self, name: str) -> list:
        """Loads of any revision of ``name``."""
        return [call for call in self.vllm.loads() if call[2].partition("@")[0] == name]

    async def chat(self, model: str) -> httpx.Response:
        return await self.http.post("/v1/chat/completions", json={"model": model, "messages": []})

    def replica(self, url: str):
        return next(replica for replica in self.pool.replicas if replica.url == url)
