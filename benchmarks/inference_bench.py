"""Inference benchmark: publish-to-first-token, mixed-adapter throughput, gateway overhead.

    .venv/bin/python benchmarks/inference_bench.py [--rounds 2] [--publishes 7] [--compare-stock]

Starts its own pool (one vLLM CPU replica, the repository's model catalog) and web gateway on a
scratch SQLite database, makes random LoRA adapters (rank 8, all linear layers) with PEFT, and
prints one table whose ratios are against baselines measured in the same run:
1. publish -> first token: a new adapter is published (store + registry row) while everything runs,
   then a streamed chat request names it; time to its first token (median of several adapters);
2. throughput: CONCURRENCY requests x TOKENS tokens, all base model, then spread over 1, 4 and 16
   adapters, through the gateway; tokens per second as a ratio to the base model's (each round
   has its own base run, and the median ratio over rounds is reported);
3. gateway overhead: sequential one-token completions straight to the vLLM replica, to the pool,
   and through the gateway, interleaved; medians of the per-request differences.
With --compare-stock it then restarts the replica with vLLM's own LoRA kernels (no
inference.lora_kernels; the same process layout) and measures throughput (2) directly against it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "platform")]

SCRATCH = Path(tempfile.mkdtemp(prefix="fineserve-bench-"))
os.environ.setdefault("INFERENCE_POOL_URL", "http://127.0.0.1:38100")
os.environ.setdefault("FIRST_REPLICA_PORT", "38200")
os.environ["DATABASE_URL"] = f"sqlite:///{SCRATCH / 'bench.sqlite3'}"
os.environ["DYNAMIC_LORA_PATH"] = str(SCRATCH / "adapters")
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "server.settings")
os.environ.setdefault("DEBUG", "true")  # a local measurement: development mode, as bin/run starts it locally
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import django

django.setup()

import logging

import httpx
from django.conf import settings
from django.core.management import call_command

from inference.replica import vllm_command, vllm_environment
from tests.inference_fixtures import (
    BASE,
    AdapterMaker,
    Persona,
    adapter_store,
    publish_fine_tuned_model,
)
from tests.processes import answers, free_port, running, wait_until

CONCURRENCY = 32
TOKENS = 64
INTERNAL = {"Authorization": f"Bearer {settings.INTERNAL_TOKEN}"}  # what the pool and replicas require
PROMPT = "Write a short story about a lighthouse keeper and a storm."


# --- set-up ------------------------------------------------------------------------------------


def _persona() -> Persona:
    from accounts.services import create_api_key, create_organization
    from django.contrib.auth.models import User

    user = User.objects.create_user("bench", "bench@example.com", "bench")
    organization = create_organization("Benchmark", user)
    _, raw_key = create_api_key(organization, user, "bench")
    return Persona(organization, raw_key, client=None)


# --- measurements ------------------------------------------------------------------------------


def publish_to_first_token(persona: Persona, folders: list[Path], gateway: str) -> list[float]:
    headers = {"Authorization": f"Bearer {persona.api_key}"}
    times = []
    with httpx.Client(timeout=120) as client:
        for index, folder in enumerate(folders):
            suffix = f"fresh-{index}-{random.randrange(1 << 30):x}"
            started = time.perf_counter()
            name = publish_fine_tuned_model(persona, suffix, folder)
            body = {"model": name, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8, "stream": True}
            with client.stream("POST", f"{gateway}/v1/chat/completions", json=body, headers=headers) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if (
                        line.startswith("data: ")
                        and '"content":"' in line.replace(" ", "")
                        and '"content":""' not in line
                    ):
                        times.append(time.perf_counter() - started)
                        break
                else:
                    raise RuntimeError(f"{name}: no token in the stream")
    return times


async def _throughput(url: str, models: list[str], api_key: str | None) -> float:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    order = [models[i % len(models)] for i in range(CONCURRENCY)]
    random.shuffle(order)

    async def one(client: httpx.AsyncClient, model: str) -> int:
        body = {"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "min_tokens": TOKENS, "ignore_eos": True,
                "temperature": 0.8}  # fmt: skip
        response = await client.post(f"{url}/v1/completions", json=body, headers=headers)
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=CONCURRENCY * 2)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        await asyncio.gather(*(one(client, model) for model in models))  # warm: adapters loaded
        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(client, model) for model in order))
        return sum(tokens) / (time.perf_counter() - started)


def throughput_rounds(url: str, adapters: list[str], api_key: str | None, rounds: int, load_adapters=None) -> dict:
    """tok/s per load, and each round's ratio to that round's base-model run."""
    loads = {"base model": [BASE], "1 adapter": adapters[:1], "4 adapters": adapters[:4], "16 adapters": adapters[:16]}
    results: dict[str, dict[str, list[float]]] = {load: {"tok_s": [], "ratio": []} for load in loads}
    for round_number in range(rounds):
        base = None
        for load, models in loads.items():
            if load_adapters:
                load_adapters(models)
            tok_s = asyncio.run(_throughput(url, models, api_key))
            base = tok_s if base is None else base
            results[load]["tok_s"].append(tok_s)
            results[load]["ratio"].append(tok_s / base)
            print(
                f"  round {round_number + 1}: {load:<12} {tok_s:7.1f} tok/s  ({tok_s / base:.2f} of base)", flush=True
            )
    return results


DIRECT, POOL, GATEWAY = "vLLM replica, direct", "pool (route, adapter check)", "gateway (auth, registry, pool)"


def overhead(replica: str, pool: str, gateway: str, api_key: str, model: str, samples: int) -> dict[str, list[float]]:
    body = {"model": model, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    paths = {
        DIRECT: (replica, INTERNAL), POOL: (pool, INTERNAL), GATEWAY: (gateway, {"Authorization": f"Bearer {api_key}"})
    }
    times: dict[str, list[float]] = {name: [] for name in paths}
    with httpx.Client(timeout=60) as client:
        for round_number in range(samples + 5):
            order = list(paths.items())[::-1]  # warm-up: the gateway first, so the adapter is loaded
            if round_number >= 5:
                random.shuffle(order)  # no path always goes first
            for name, (url, headers) in order:
                started = time.perf_counter()
                client.post(f"{url}/v1/completions", json=body, headers=headers).raise_for_status()
                if round_number >= 5:  # warm-up rounds do not count
                    times[name].append(time.perf_counter() - started)
    return times


# --- stock vLLM, for comparison ----------------------------------------------------------------


def stock_vllm_throughput(adapter_folders: dict[str, Path], rounds: int) -> dict:
    model = settings.MODEL_CATALOG.get(BASE)
    port = free_port()
    command = vllm_command(model, port, server_module="vllm.entrypoints.openai.api_server")
    url = f"http://127.0.0.1:{port}"
    loaded: set[str] = set()

    def load(models: list[str]) -> None:
        wanted = [name for name in models if name != BASE]
        for name in list(loaded):  # stock vLLM: keep at most max_cpu_loras registered, like the pool
            if name not in wanted and len(loaded) + len(wanted) > model.lora.max_num_adapters_per_replica:
                httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=INTERNAL, timeout=60)
                loaded.discard(name)
        for name in wanted:
            if name not in loaded:
                body = {"lora_name": name, "lora_path": str(adapter_folders[name])}
                httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=INTERNAL, timeout=60).raise_for_status()
                loaded.add(name)

    with running("bench-stock-vllm", command, vllm_environment(model, settings.INTERNAL_TOKEN)) as process:
        wait_until(lambda: answers(f"{url}/health", headers=INTERNAL), 600, "stock vLLM", process)
        return throughput_rounds(url, list(adapter_folders), settings.INTERNAL_TOKEN, rounds, load_adapters=load)


# --- report ------------------------------------------------------------------------------------


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:8.2f}"


def report(publish: list[float], throughput: dict, stock: dict | None, latencies: dict, catalog_line: str) -> None:
    print()
    print("=" * 78)
    print(f"Inference benchmark, {BASE}, 1 replica; {catalog_line}")
    print(f"machine: {os.cpu_count()} cores, load average now {os.getloadavg()[0]:.1f} (other work included)")
    print("-" * 78)
    median = statistics.median(publish)
    verdict = "PASS" if median < 2 else "MISS"
    print(f"(1) publish -> first token, n={len(publish)}: median {median:.2f} s "
          f"(min {min(publish):.2f}, max {max(publish):.2f})      target < 2 s: {verdict}")  # fmt: skip
    print("-" * 78)
    print(f"(2) throughput, {CONCURRENCY} concurrent x {TOKENS} tokens, through the gateway (median of rounds)")
    header = f"    {'load':<14}{'tok/s':>9}{'ratio to base':>15}"
    if stock:
        header += f"{'stock vLLM tok/s':>18}{'ratio':>7}"
    print(header)
    for load, values in throughput.items():
        ratio = statistics.median(values["ratio"])
        line = f"    {load:<14}{statistics.median(values['tok_s']):9.1f}{ratio:15.2f}"
        if stock:
            line += f"{statistics.median(stock[load]['tok_s']):18.1f}{statistics.median(stock[load]['ratio']):7.2f}"
        if load == "4 adapters":
            line += f"   target >= 0.8: {'PASS' if ratio >= 0.8 else 'MISS'}"
        print(line)
    print("-" * 78)
    for label, latency in latencies.items():
        samples = len(latency[DIRECT])
        print(f"(3) one-token completions of the {label}, sequential, n={samples} each: median ms")
        for path, values in latency.items():
            extra = statistics.median(b - a for a, b in zip(latency[DIRECT], values))
            print(f"    {path:<32}{_ms(values)}   overhead {extra * 1000:6.2f} ms")
    gateway = statistics.median(
        b - a for a, b in zip(latencies["base model"][DIRECT], latencies["base model"][GATEWAY])
    )
    print(f"    gateway overhead target < 5 ms: {'PASS' if gateway < 0.005 else 'MISS'}")
    print("=" * 78)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="throughput rounds (each has its own base run)")
    parser.add_argument("--publishes", type=int, default=7, help="fresh adapters for publish-to-first-token")
    parser.add_argument("--overhead-samples", type=int, default=100)
    parser.add_argument("--compare-stock", action="store_true", help="also measure throughput on stock vLLM")
    args = parser.parse_args()

    logging.getLogger("httpx").setLevel(logging.WARNING)
    print(f"scratch: {SCRATCH}", flush=True)
    call_command("migrate", verbosity=0)
    persona = _persona()
    maker = AdapterMaker(SCRATCH / "made")
    print("making adapters ...", flush=True)
    folders = {f"{BASE}:mix{i}": maker(seed=100 + i) for i in range(16)}
    fresh = [maker(seed=200 + i) for i in range(args.publishes)]
    for name, folder in folders.items():
        publish_fine_tuned_model(persona, name.rpartition(":")[2], folder)

    model = settings.MODEL_CATALOG.get(BASE)
    catalog_line = (
        f"dtype {model.engine.dtype}, max_loras {model.engine.max_loras}, max_num_adapters_per_replica "
        f"{model.lora.max_num_adapters_per_replica}, max_lora_rank {model.lora.max_lora_rank}"
    )
    pool_url = settings.INFERENCE_POOL_URL
    env = {
        key: os.environ[key]
        for key in ("DATABASE_URL", "DYNAMIC_LORA_PATH", "INFERENCE_POOL_URL", "FIRST_REPLICA_PORT")
    }
    gateway_port = free_port()
    gateway = f"http://127.0.0.1:{gateway_port}"
    web = [sys.executable, "-m", "uvicorn", "server.asgi:application", "--app-dir", "platform",
           "--host", "127.0.0.1", "--port", str(gateway_port), "--log-level", "warning"]  # fmt: skip
    with (
        running("bench-pool", [sys.executable, "-m", "inference"], env) as pool_process,
        running("bench-gateway", web, env) as web_process,
    ):
        print("waiting for the engine ...", flush=True)
        wait_until(lambda: answers(f"{pool_url}/health", headers=INTERNAL), 600, "pool", pool_process)
        wait_until(lambda: httpx.get(f"{gateway}/v1/models").status_code == 401, 60, "gateway", web_process)
        replica = httpx.get(f"{pool_url}/health", headers=INTERNAL).json()["replicas"][0]["url"]

        print("(1) publish -> first token ...", flush=True)
        publish = publish_to_first_token(persona, fresh, gateway)
        print("(3) overhead ...", flush=True)
        adapter = next(iter(folders))
        latencies = {
            "base model": overhead(replica, pool_url, gateway, persona.api_key, BASE, args.overhead_samples),
            "adapter": overhead(replica, pool_url, gateway, persona.api_key, adapter, args.overhead_samples),
        }
        print("(2) throughput ...", flush=True)
        throughput = throughput_rounds(gateway, list(folders), persona.api_key, args.rounds)
    stock = None
    if args.compare_stock:
        print("(2) throughput on stock vLLM ...", flush=True)
        stock_folders = {name: adapter_store().fetch(name, SCRATCH) for name in folders}
        stock = stock_vllm_throughput(stock_folders, args.rounds)
    report(publish, throughput, stock, latencies, catalog_line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
