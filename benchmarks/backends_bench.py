"""Backend benchmark: the embedded pool against Ray Serve, serving the same model the same way.

    .venv/bin/python benchmarks/backends_bench.py [--rounds 2] [--wakes 5]

Needs the Ray extra (``pip install -c constraints.txt ".[ray]"``). Each round starts each backend
in turn (``python -m inference`` and ``python -m inference.ray_serve``) with one catalog model
scaled to zero (``min_replicas = 0``, the repository catalog's engine and LoRA settings), and
measures, straight to the backend with the internal token (the gateway in front is the same):
1. cold start, stopped (``idle = "stop"``): from the first request (nothing running) to its first
   streamed token;
2. throughput: CONCURRENCY chat requests of TOKENS tokens at once, all for the base model, then
   spread over ADAPTERS adapters (random rank-8 PEFT adapters, loaded by a warm-up first);
3. then started again asleep (``idle = "sleep"``, a short ``downscale_delay_s``): ``--wakes`` times,
   once the model is asleep, from a request to its first streamed token, for the base model and
   for an adapter (the median);
then stops it. Once per run, stock vLLM's own server (``vllm.entrypoints.openai.api_server``, the
same engine settings) is started alone: from its spawn to its first streamed token. Prints the
medians over rounds, and Ray's ratio to the embedded pool's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]  # the repository's packages, for the imports below
os.environ.setdefault("DEBUG", "true")  # a local measurement: development mode, as bin/run starts it locally

from core.adapter_store import LocalAdapterStore
from core.config import load_config
from core.internal_token import bearer
from inference.replica import vllm_command, vllm_environment
from tests.inference_fixtures import BASE, AdapterMaker
from tests.processes import answers, free_port, running, wait_until

CONCURRENCY = 32
TOKENS = 64
ADAPTERS = 4
PROMPT = "Write a short story about a lighthouse keeper and a storm."
SCRATCH = Path(tempfile.mkdtemp(prefix="fineserve-backends-"))
BACKENDS = {  # the name in the table: the catalog's backend, and the command that serves it
    "embedded pool": ("embedded", [sys.executable, "-m", "inference"]),
    "Ray Serve": ("ray", [sys.executable, "-m", "inference.ray_serve"]),
}


IDLE_S = 2  # downscale_delay_s when asleep: the model falls asleep again soon after each request


def _catalog(backend: str, idle: str) -> Path:
    """The repository catalog's model, on ``backend``, scaled to zero, idle as ``idle`` says; a
    request waits for it."""
    text = (ROOT / "models.toml").read_text()
    text = text.replace('backend = "embedded"', f'backend = "{backend}"').replace("min_replicas = 1", "min_replicas = 0")
    text = text.replace('idle = "sleep"', f'idle = "{idle}"')
    text = text.replace("cold_start_wait_s = 60", "cold_start_wait_s = 600")
    if idle == "sleep":
        text = text.replace("downscale_delay_s = 600", f"downscale_delay_s = {IDLE_S}")
    path = SCRATCH / f"{backend}-{idle}.toml"
    path.write_text(text)
    return path


def _body(model: str, stream: bool = False) -> dict:
    return {
        "model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": TOKENS,
        "min_tokens": TOKENS, "ignore_eos": True, "temperature": 0.8, "stream": stream,
    }


def first_token_s(url: str, headers: dict[str, str], model: str = BASE) -> float:
    started = time.perf_counter()
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=_body(model, stream=True), headers=headers, timeout=900
    ) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                return time.perf_counter() - started
    raise RuntimeError("the stream ended without a token")


async def tokens_per_s(url: str, headers: dict[str, str], models: list[str]) -> float:
    order = [models[i % len(models)] for i in range(CONCURRENCY)]
    async with httpx.AsyncClient(
        timeout=900, headers=headers, limits=httpx.Limits(max_connections=2 * CONCURRENCY)
    ) as client:

        async def one(model: str) -> int:
            response = await client.post(f"{url}/v1/chat/completions", json=_body(model))
            response.raise_for_status()
            return response.json()["usage"]["completion_tokens"]

        await asyncio.gather(*(one(model) for model in set(order)))  # warm: every adapter loaded
        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(model) for model in order))
        return sum(tokens) / (time.perf_counter() - started)


def _environment(backend: str, idle: str) -> tuple[str, dict[str, str]]:
    url = f"http://127.0.0.1:{free_port()}"
    return url, {
        "MODEL_CATALOG": str(_catalog(backend, idle)),
        "DYNAMIC_LORA_PATH": str(SCRATCH / "adapters"),
        "INFERENCE_POOL_URL": url, "RAY_SERVE_URL": url, "FIRST_REPLICA_PORT": str(free_port()),
    }


def _state(url: str, headers: dict[str, str]) -> str | None:
    try:
        return httpx.get(f"{url}/health", headers=headers, timeout=10).json()["models"][BASE]["state"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def measure(name: str, backend: str, command: list[str], adapters: list[str], token: str, wakes: int) -> dict[str, float]:
    headers = {"Authorization": bearer(token)}
    url, environment = _environment(backend, "stop")
    with running(f"bench-{backend}", command, environment) as process:
        wait_until(lambda: answers(f"{url}/health", headers=headers), 300, name, process)
        results = {"stopped: to the first token, s": first_token_s(url, headers)}
        results[f"{CONCURRENCY} at once, base, tok/s"] = asyncio.run(tokens_per_s(url, headers, [BASE]))
        results[f"{CONCURRENCY} at once, {ADAPTERS} adapters, tok/s"] = asyncio.run(
            tokens_per_s(url, headers, adapters)
        )
    url, environment = _environment(backend, "sleep")
    woken: dict[str, list[float]] = {BASE: [], adapters[0]: []}
    with running(f"bench-{backend}-asleep", command, environment) as process:
        for _ in range(wakes):
            for model, times in woken.items():
                wait_until(lambda: _state(url, headers) == "asleep", 300, f"{name}: the model asleep", process)
                times.append(first_token_s(url, headers, model))
    results["asleep: base, to the first token, s"] = statistics.median(woken[BASE])
    results["asleep: adapter, to the first token, s"] = statistics.median(woken[adapters[0]])
    return results


def stock_vllm_first_token_s(token: str) -> float:
    """Stock vLLM's server for the catalog's first model, with its engine settings: from the spawn to
    the first streamed token."""
    model, port = load_config().catalog().models[0], free_port()
    url, headers = f"http://127.0.0.1:{port}", {"Authorization": bearer(token)}
    started = time.perf_counter()
    command = vllm_command(model, port, "vllm.entrypoints.openai.api_server")
    with running("bench-stock-vllm", command, vllm_environment(model, token)) as process:
        wait_until(lambda: answers(f"{url}/health", headers=headers), 900, "stock vLLM", process)
        first_token_s(url, headers)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--wakes", type=int, default=5, help="wakes per model and round, asleep")
    args = parser.parse_args()
    token = load_config().internal_token
    store, make = LocalAdapterStore(SCRATCH / "adapters"), AdapterMaker(SCRATCH / "made")
    adapters = [f"{BASE}:bench{seed}" for seed in range(ADAPTERS)]
    for seed, name in enumerate(adapters):
        store.publish(name, make(seed))
    results: dict[str, list[dict[str, float]]] = {name: [] for name in BACKENDS}
    for round_number in range(1, args.rounds + 1):
        for name, (backend, command) in BACKENDS.items():
            results[name].append(measure(name, backend, command, adapters, token, args.wakes))
            print(f"  round {round_number}: {name}: {results[name][-1]}", flush=True)

    embedded, ray = (
        {metric: statistics.median(run[metric] for run in runs) for metric in runs[0]} for runs in results.values()
    )
    print(
        f"\n{'median of ' + str(args.rounds) + ' rounds':<40}{'embedded pool':>15}{'Ray Serve':>15}{'Ray / pool':>12}"
    )
    for metric in embedded:
        print(f"{metric:<40}{embedded[metric]:>15.2f}{ray[metric]:>15.2f}{ray[metric] / embedded[metric]:>11.2f}x")
    stock = stock_vllm_first_token_s(token)
    print(f"stock vLLM's own server (no pool, no kernels), from its spawn to the first token: {stock:.1f} s")


if __name__ == "__main__":
    main()
