"""Inference benchmark: publish-to-first-token, mixed-adapter throughput, gateway overhead, mixes.

    .venv/bin/python benchmarks/inference_bench.py [--rounds 2] [--publishes 10] [--compare-stock] [--model ID]
                                                   [--mix-only | --publish-only | --throughput-only | --overhead-only]

Starts its own pool (one vLLM CPU replica, the repository's model catalog) and web gateway on a
scratch SQLite database, makes random LoRA adapters (rank 8, all linear layers) with PEFT, and
prints one table whose ratios are against baselines measured in the same run:
1. publish -> first token: a new adapter is published (store + registry row) while everything runs,
   then a streamed chat request names it; time to its first token (median of several adapters),
   alternately with and without the preload a finished job asks of the pool (``POST
   /v1/adapters/preload``: loaded where its requests will go before the first one comes);
2. throughput: CONCURRENCY requests x TOKENS tokens, all base model, then spread over 1, 4, 16 and
   MANY_ADAPTERS adapters (round robin: each of them once, CONCURRENCY in flight), through the
   gateway; then HELD_ADAPTERS adapters, all loaded first (one token each), the timed requests each
   a different one of them; tokens per second as a ratio to the base model's (measured just before
   and just after each load, in every round; the median ratio over rounds is reported, with each
   round's), the same ratio of the engine's CPU time per token (the engine's own work, apart from
   the processes that share its cores), and how many
   adapters the pool loaded during the timed runs (0: the warm tier held them all, and each
   batch's slot swaps were host-memory copies, no disk read);
3. gateway overhead: sequential one-token completions straight to the vLLM replica, to the pool,
   and through the gateway, interleaved; medians of the per-request differences; the same for a
   one-token chat that declares a tool (its shape and schema checked by the gateway);
4. mixes and scales (docs/api.md: Mixing adapters), computed in the kernel from their parts' slots
   (inference/engine/mixes.py): CONCURRENCY chat requests x TOKENS tokens through the gateway over
   the base model (the baseline), CONCURRENCY plain adapters, CONCURRENCY distinct mixes (two of
   MIX_WIDTH adapters each, at scales of their own), one adapter, and that adapter at CONCURRENCY
   scales (the scale sweep); tokens per second as a ratio to the base model's, each round's listed,
   and the two comparisons the kernel is for (mixes / plain adapters, sweep / one adapter), with
   the adapter loads and evictions the section caused. Then the first request's cost: time to the
   first token of a warm adapter asked again, against a new mix of warm adapters, interleaved.
   It adds a few minutes to a run; --mix-only runs only this section (no 1-3).
With --compare-stock it then restarts the replica with vLLM's own LoRA kernels (no
inference.engine kernels; the same process layout) and measures throughput (2) directly against it.
--model measures another base model of the catalog (MODEL_CATALOG; ``manage.py add_base_model``
adds one): its pool serves that model alone, and the adapters are made on it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
import psutil
from django.conf import settings
from django.core.management import call_command

from core.catalog import BaseModel, catalog_entry
from core.catalog_file import with_model_appended
from core.model_names import pinned_name
from inference.replica import vllm_command, vllm_environment
from tests.inference_fixtures import (
    BASE,
    AdapterMaker,
    Persona,
    adapter_store,
    publish_fine_tuned_model,
)
from tests.processes import answers, free_port, running, wait_until
from tests.tool_calling import WEATHER_TOOL

CONCURRENCY = 32
# Every load's timed run sends as many requests, two waves of CONCURRENCY: the base model and 64
# adapters do the same work in the same pattern (64 adapters need 64 requests to use each once).
TIMED_REQUESTS = 2 * CONCURRENCY
TOKENS = 64
MANY_ADAPTERS = 64  # (2)'s widest round robin: far more adapters than a replica's batch slots (max_loras)
HELD_ADAPTERS = 1000  # (2)'s warm tier load: a platform whose every fine-tune gets a little traffic
MIX_WIDTH = 8  # (4)'s mixes are pairs of these many adapters: their parts share slots
SWEEP = [round(0.25 + 1.5 * i / CONCURRENCY, 4) for i in range(CONCURRENCY)]  # (4)'s distinct scales, 0.25 to 1.7
FIRST_REQUEST_SAMPLES = 8  # (4)'s first-request pairs (a first token varies by tens of ms)
INTERNAL = {"Authorization": f"Bearer {settings.INTERNAL_TOKEN}"}  # what the pool and replicas require
PROMPT = "Write a short story about a lighthouse keeper and a storm."
MODEL = BASE  # the base model measured (--model)


# --- set-up ------------------------------------------------------------------------------------


def _catalog_of(model: BaseModel) -> Path:
    """A catalog of this model alone, for the pool: no other model's replica takes the cores."""
    catalog = SCRATCH / "models.toml"
    config = settings.CONFIG
    catalog.write_text(with_model_appended("", catalog_entry(model, config.data_dir, config.dynamic_lora_path)))
    return catalog


def _persona() -> Persona:
    from accounts.services import create_api_key, create_organization
    from django.contrib.auth.models import User

    user = User.objects.create_user("bench", "bench@example.com", "bench")
    organization = create_organization("Benchmark", user)
    _, raw_key = create_api_key(organization, user, "bench")
    return Persona(organization, raw_key, client=None)


@contextmanager
def serving(model: BaseModel) -> Iterator[tuple[str, str, subprocess.Popen]]:
    """The pool (one replica of ``model``) and the web gateway, running until the block ends:
    (the gateway's URL, the replica's URL, the pool's process)."""
    env = {
        key: os.environ[key]
        for key in ("DATABASE_URL", "DYNAMIC_LORA_PATH", "INFERENCE_POOL_URL", "FIRST_REPLICA_PORT")
    } | {"MODEL_CATALOG": str(_catalog_of(model))}
    pool_url = settings.INFERENCE_POOL_URL
    gateway_port = free_port()
    gateway = f"http://127.0.0.1:{gateway_port}"
    web = [sys.executable, "-m", "uvicorn", "server.asgi:application", "--app-dir", "platform",
           "--host", "127.0.0.1", "--port", str(gateway_port), "--log-level", "warning"]
    with (
        running("bench-pool", [sys.executable, "-m", "inference"], env) as pool_process,
        running("bench-gateway", web, env) as web_process,
    ):
        print("waiting for the engine ...", flush=True)
        wait_until(lambda: answers(f"{pool_url}/health", headers=INTERNAL), 600, "pool", pool_process)
        wait_until(lambda: httpx.get(f"{gateway}/v1/models").status_code == 401, 60, "gateway", web_process)
        replica = httpx.get(f"{pool_url}/health", headers=INTERNAL).json()["replicas"][0]["url"]
        yield gateway, replica, pool_process


# --- measurements ------------------------------------------------------------------------------


def _until_first_token(client: httpx.Client, gateway: str, api_key: str, target: dict) -> None:
    """Stream a short chat answer from ``target`` (a model, or a mix) and return at its first token."""
    body = {**target, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8, "stream": True}
    headers = {"Authorization": f"Bearer {api_key}"}
    with client.stream("POST", f"{gateway}/v1/chat/completions", json=body, headers=headers) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            # the first chunk carries the role and an empty content: not a token yet
            if line.startswith("data: ") and '"content":"' in line.replace(" ", "") and '"content":""' not in line:
                return
    raise RuntimeError(f"{target}: no token in the stream")


def _fresh_suffix(label: str, index: int) -> str:
    """A suffix no earlier run used: a published name must never be one the pool has seen."""
    return f"{label}-{index}-{random.randrange(1 << 30):x}"


def publish_to_first_token(persona: Persona, folders: list[Path], gateway: str, pool: str) -> dict[str, list]:
    """Per fresh adapter, alternately: published, then asked at once (it loads on that request); or
    published, preloaded as a finished job does (``POST /v1/adapters/preload``), then asked. Each
    sample: (publish -> first token, the request's own time to first token)."""
    times: dict[str, list] = {"on first request": [], "preloaded": []}
    with httpx.Client(timeout=120) as client:
        for index, folder in enumerate(folders):
            preloaded = index % 2 == 1
            started = time.perf_counter()
            name = publish_fine_tuned_model(persona, _fresh_suffix("fresh", index), folder, MODEL)
            if preloaded:
                client.post(f"{pool}/v1/adapters/preload", json={"model": name}, headers=INTERNAL).raise_for_status()
            asked = time.perf_counter()
            _until_first_token(client, gateway, persona.api_key, {"model": name})
            done = time.perf_counter()
            times["preloaded" if preloaded else "on first request"].append((done - started, done - asked))
    return times


def variant(adapter: Path, seed: int, out: Path) -> Path:
    """Another adapter of the same shape: each weight of ``adapter`` times a random factor in
    [0.5, 1.5), saved in half precision (as the kernel holds it; half the disk of float32)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from core.adapter_store import CONFIG_FILE, WEIGHTS_FILE

    rng = np.random.default_rng(seed)
    weights = load_file(adapter / WEIGHTS_FILE)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {key: (value * rng.uniform(0.5, 1.5, value.shape)).astype(np.float16) for key, value in weights.items()},
        out / WEIGHTS_FILE,
    )
    (out / CONFIG_FILE).write_bytes((adapter / CONFIG_FILE).read_bytes())
    return out


def mix_target(parts: list[tuple[str, float]]) -> dict:
    """A request's model fields for a mix: the base model, plus the adapters and their scales."""
    return {"model": MODEL, "adapters": [{"model": name, "scale": scale} for name, scale in parts]}


def first_request_cost(persona: Persona, adapters: list[str], gateway: str) -> dict[str, list[float]]:
    """Time to the first token of a warm adapter asked again, and of a new mix of two warm adapters
    (a scale nobody asked for before): in the kernel, a mix costs no build and no load of its own.
    The two kinds alternate which goes first."""
    times: dict[str, list[float]] = {"warm adapter": [], "new mix": []}
    with httpx.Client(timeout=120) as client:
        for index in range(FIRST_REQUEST_SAMPLES):
            first, second = adapters[2 * index], adapters[2 * index + 1]
            for name in (first, second):
                _until_first_token(client, gateway, persona.api_key, {"model": name})
            targets = {
                "warm adapter": {"model": first},
                "new mix": mix_target([(first, 0.35 + index / 10), (second, 0.6)]),
            }
            for kind in sorted(targets, reverse=index % 2 == 1):
                started = time.perf_counter()
                _until_first_token(client, gateway, persona.api_key, targets[kind])
                times[kind].append(time.perf_counter() - started)
    return times


# A load is the request targets spread over the CONCURRENCY requests; a target is the fields that
# choose the weights: {"model": name}, or a mix (``mix_target``).
Loads = dict[str, list[dict]]


def adapter_loads(adapters: list[str]) -> Loads:
    """(2)'s loads: the base model first (the ratios' baseline), then 1, 4, 16, MANY_ADAPTERS and
    HELD_ADAPTERS adapters (those past MANY_ADAPTERS, when given)."""
    spreads = {"base model": [MODEL]} | {
        f"{n} adapter{'s' if n > 1 else ''}": adapters[:n] for n in (1, 4, 16, MANY_ADAPTERS, HELD_ADAPTERS) if n <= len(adapters)
    }
    return {load: [{"model": model} for model in models] for load, models in spreads.items()}


MIXES, PLAIN, ONE, SWEPT = f"{CONCURRENCY} mixes", f"{CONCURRENCY} adapters", "1 adapter", f"1 x {CONCURRENCY} scales"


def mix_loads(adapters: list[str]) -> Loads:
    """(4)'s loads: the base model first (the ratios' baseline); CONCURRENCY plain adapters;
    CONCURRENCY distinct mixes, each two of the first MIX_WIDTH adapters (a neighbour and the
    next), the first at a scale of its own; one adapter; and that adapter at every scale of SWEEP."""
    parts = adapters[:MIX_WIDTH]
    return {
        "base model": [{"model": MODEL}],
        PLAIN: [{"model": name} for name in adapters[:CONCURRENCY]],
        MIXES: [
            mix_target([(parts[i % MIX_WIDTH], scale), (parts[(i + 1) % MIX_WIDTH], 0.5)])
            for i, scale in enumerate(SWEEP)
        ],
        ONE: [{"model": adapters[0]}],
        SWEPT: [mix_target([(adapters[0], scale)]) for scale in SWEEP],
    }


def _request_body(target: dict, endpoint: str) -> dict:
    text = {"prompt": PROMPT} if endpoint == "completions" else {"messages": [{"role": "user", "content": PROMPT}]}
    return {**target, **text, "max_tokens": TOKENS, "min_tokens": TOKENS, "ignore_eos": True, "temperature": 0.8}


async def _throughput(
    url: str, targets: list[dict], api_key: str | None, endpoint: str, warmed: Callable[[], None] = lambda: None
) -> tuple[int, float]:
    """TIMED_REQUESTS requests over the targets in round robin (every target at least once, up to
    MANY_ADAPTERS of them; past that, TIMED_REQUESTS different ones), CONCURRENCY in flight;
    ``warmed`` is called between the untimed warm-up (every target once, one token each past
    MANY_ADAPTERS: just loaded) and the timed run. Returns the timed run's tokens and seconds."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    held = len(targets) > MANY_ADAPTERS
    order = (
        random.sample(targets, TIMED_REQUESTS)
        if held
        else [targets[i % len(targets)] for i in range(max(TIMED_REQUESTS, len(targets)))]
    )
    random.shuffle(order)
    in_flight = asyncio.Semaphore(CONCURRENCY)

    async def one(client: httpx.AsyncClient, target: dict, tokens: int = TOKENS) -> int:
        body = {**_request_body(target, endpoint), "max_tokens": tokens, "min_tokens": tokens}
        async with in_flight:
            response = await client.post(f"{url}/v1/{endpoint}", json=body, headers=headers)
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=CONCURRENCY * 2)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        # warm: adapters loaded (mixes built)
        await asyncio.gather(*(one(client, target, 1 if held else TOKENS) for target in targets))
        warmed()
        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(client, target) for target in order))
        return sum(tokens), time.perf_counter() - started


def throughput_rounds(
    url: str,
    loads: Loads,
    api_key: str | None,
    rounds: int,
    engine: psutil.Process,
    load_adapters=None,
    endpoint: str = "completions",
    pool: str | None = None,
) -> dict:
    """tok/s per load, and each round's ratio to the first load's (the baseline's) runs just before
    and just after it: the baseline runs again after every other load, so a machine that slows or
    speeds up during a round moves both sides of a ratio alike. With ``pool``, also the adapters the
    pool loaded during each timed run (0: every slot swap was a copy from host memory, none a read
    from the store). And the engine's (``engine``: vLLM's engine-core process) CPU time per
    generated token, as the same kind of ratio (the base model's over the load's: 1.0 = as cheap as
    the base model): the engine's own work, apart from the gateway, the pool and the benchmark's
    client, which share this machine's cores with it and take more or less of them from run to run."""
    results: dict[str, dict[str, list[float]]] = {
        load: {"tok_s": [], "ratio": [], "loads": [], "cpu_ratio": []} for load in loads
    }
    baseline, *others = loads

    def run(load: str) -> tuple[float, float]:
        targets = loads[load]
        if load_adapters:
            load_adapters([target["model"] for target in targets])
        loads_before: list[float] = []
        cpu_before: list[float] = []

        def warmed() -> None:
            if pool:
                loads_before.append(adapter_churn(pool)["loads"])
            cpu_before.append(_cpu_seconds(engine))

        tokens, seconds = asyncio.run(_throughput(url, targets, api_key, endpoint, warmed))
        if pool:
            results[load]["loads"].append(adapter_churn(pool)["loads"] - loads_before[0])
        cpu_per_token = (_cpu_seconds(engine) - cpu_before[0]) / tokens
        results[load]["tok_s"].append(tokens / seconds)
        return tokens / seconds, cpu_per_token

    for round_number in range(rounds):
        base_before = run(baseline)
        results[baseline]["ratio"].append(1.0)
        results[baseline]["cpu_ratio"].append(1.0)
        for load in others:
            (tok_s, cpu), base_after = run(load), run(baseline)
            ratio = tok_s / statistics.mean((base_before[0], base_after[0]))
            cpu_ratio = statistics.mean((base_before[1], base_after[1])) / cpu
            results[load]["ratio"].append(ratio)
            results[load]["cpu_ratio"].append(cpu_ratio)
            print(
                f"  round {round_number + 1}: {load:<12} {tok_s:7.1f} tok/s  ({ratio:.2f} of {baseline}: "
                f"{base_before[0]:.1f} before, {base_after[0]:.1f} after); engine CPU {cpu * 1000:.2f} ms/token "
                f"({cpu_ratio:.2f} of {baseline}'s)",
                flush=True,
            )
            base_before = base_after
    return results


def engine_process(server: subprocess.Popen) -> psutil.Process:
    """vLLM's engine-core process under the pool (or under a vLLM server), where the model runs."""
    for process in psutil.Process(server.pid).children(recursive=True):
        if "EngineCore" in " ".join(process.cmdline()) or "EngineCore" in process.name():
            return process
    raise RuntimeError("no vLLM engine-core process under the server")


def _cpu_seconds(process: psutil.Process) -> float:
    """The process's CPU time so far, every thread's, user and system."""
    times = process.cpu_times()
    return times.user + times.system


def adapter_churn(pool: str) -> dict[str, float]:
    """The pool's adapter loads and evictions so far (its Prometheus counters), to tell slot thrash."""
    text = httpx.get(f"{pool}/metrics", headers=INTERNAL, timeout=30).text
    churn = {"loads": 0.0, "evictions": 0.0}
    for line in text.splitlines():
        if line.startswith("fineserve_adapter_loads_total{") and 'outcome="loaded"' in line:
            churn["loads"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("fineserve_adapter_evictions_total{"):
            churn["evictions"] += float(line.rsplit(" ", 1)[1])
    return churn


def mix_section(
    persona: Persona, gateway: str, pool: str, engine: psutil.Process, adapters: list[str], rounds: int
) -> dict:
    """(4): plain adapters, mixes and scales, the slots' churn meanwhile, and the first request's cost."""
    before = adapter_churn(pool)
    loads = mix_loads(adapters)
    throughput = throughput_rounds(
        gateway, loads, persona.api_key, rounds, engine, endpoint="chat/completions", pool=pool
    )
    after = adapter_churn(pool)
    held = httpx.get(f"{pool}/health", headers=INTERNAL, timeout=30).json()["replicas"][0]["adapters"]
    print("  first requests ...", flush=True)
    return {
        "throughput": throughput,
        "churn": {key: after[key] - before[key] for key in before},
        "held": held,
        "first": first_request_cost(persona, adapters[-2 * FIRST_REQUEST_SAMPLES :], gateway),
        "rounds": rounds,
    }


DIRECT, POOL, GATEWAY = "vLLM replica, direct", "pool (route, adapter check)", "gateway (auth, registry, pool)"


def overhead(
    replica: str, pool: str, gateway: str, api_key: str, model: str, samples: int, tools: list[dict] | None = None
) -> dict[str, list[float]]:
    """The replica holds a fine-tuned model under its revision's name; the pool and the gateway pin it.
    With ``tools``: a one-token chat that declares them (the gateway checks their shape and schemas)."""
    found = adapter_store().version(model) if model != MODEL else None
    held_as = pinned_name(model, found.version) if found else model
    paths = {
        DIRECT: (replica, INTERNAL, held_as),
        POOL: (pool, INTERNAL, model),
        GATEWAY: (gateway, {"Authorization": f"Bearer {api_key}"}, model),
    }
    times: dict[str, list[float]] = {name: [] for name in paths}
    with httpx.Client(timeout=60) as client:
        for round_number in range(samples + 5):
            order = list(paths.items())[::-1]  # warm-up: the gateway first, so the adapter is loaded
            if round_number >= 5:
                random.shuffle(order)  # no path always goes first
            for name, (url, headers, named) in order:
                body = {"model": named, "max_tokens": 1, "temperature": 0}
                if tools:
                    body |= {"messages": [{"role": "user", "content": "Hi"}], "tools": tools}
                else:
                    body["prompt"] = "Hi"
                started = time.perf_counter()
                endpoint = "chat/completions" if tools else "completions"
                client.post(f"{url}/v1/{endpoint}", json=body, headers=headers).raise_for_status()
                if round_number >= 5:  # warm-up rounds do not count
                    times[name].append(time.perf_counter() - started)
    return times


# --- stock vLLM, for comparison ----------------------------------------------------------------


def stock_vllm_throughput(adapter_folders: dict[str, Path], rounds: int) -> dict:
    model = settings.MODEL_CATALOG.get(MODEL)
    port = free_port()
    command = vllm_command(model, port, server_module="vllm.entrypoints.openai.api_server")
    url = f"http://127.0.0.1:{port}"
    loaded: set[str] = set()

    def load(models: list[str]) -> None:
        wanted = [name for name in models if name != MODEL]
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
        loads = adapter_loads(list(adapter_folders))
        engine = engine_process(process)
        return throughput_rounds(url, loads, settings.INTERNAL_TOKEN, rounds, engine, load_adapters=load)


# --- report ------------------------------------------------------------------------------------


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:8.2f}"


def _report_publish(publish: dict[str, list]) -> None:
    print("(1) publish -> first token, medians (interleaved)      total    the request alone")
    for label, samples in publish.items():
        total, request = statistics.median(t for t, _ in samples), statistics.median(r for _, r in samples)
        print(f"    {label:<22} n={len(samples):<2}                 {total:6.3f} s   {request:6.3f} s")
    preloaded = statistics.median(t for t, _ in publish["preloaded"])
    print(f"    target: publish -> first token < 0.5 s with preloading: {'PASS' if preloaded < 0.5 else 'MISS'}")
    print("-" * 78)


def _rounds(values: list[float]) -> str:
    return " ".join(f"{value:.2f}" for value in values)


def _report_throughput(throughput: dict, stock: dict | None) -> None:
    print(f"(2) throughput, {CONCURRENCY} concurrent x {TOKENS} tokens, through the gateway (median of rounds)")
    header = f"    {'load':<14}{'tok/s':>9}{'ratio to base':>15}{'engine CPU':>12}{'loads timed':>13}"
    if stock:
        header += f"{'stock vLLM tok/s':>18}{'ratio':>7}"
    print(header)
    for load, values in throughput.items():
        ratio = statistics.median(values["ratio"])
        line = (
            f"    {load:<14}{statistics.median(values['tok_s']):9.1f}{ratio:15.2f}"
            f"{statistics.median(values['cpu_ratio']):12.2f}{max(values['loads'], default=0):13.0f}"
        )
        if stock:
            line += f"{statistics.median(stock[load]['tok_s']):18.1f}{statistics.median(stock[load]['ratio']):7.2f}"
        if load in ("1 adapter", f"{MANY_ADAPTERS} adapters"):
            line += f"   target >= 0.95: {'PASS' if ratio >= 0.95 else 'MISS'}"
        if load == f"{HELD_ADAPTERS} adapters":
            line += f"   target >= 0.85, 0 loads: {'PASS' if ratio >= 0.85 and not max(values['loads']) else 'MISS'}"
        line += f"   rounds {_rounds(values['ratio'])}; engine CPU {_rounds(values['cpu_ratio'])}"
        print(line)
    print("    engine CPU: the base model's engine CPU time per token over the load's (the engine's own work,")
    print("    apart from the gateway, pool and client that share the cores with it)")
    print("-" * 78)


def _report_overhead(latencies: dict) -> None:
    for label, latency in latencies.items():
        samples = len(latency[DIRECT])
        print(f"(3) one-token answers of the {label}, sequential, n={samples} each: median ms")
        for path, values in latency.items():
            extra = statistics.median(b - a for a, b in zip(latency[DIRECT], values))
            print(f"    {path:<32}{_ms(values)}   overhead {extra * 1000:6.2f} ms")
    gateway = statistics.median(
        b - a for a, b in zip(latencies["base model"][DIRECT], latencies["base model"][GATEWAY])
    )
    print(f"    gateway overhead target < 5 ms: {'PASS' if gateway < 0.005 else 'MISS'}")
    print("-" * 78)


def _report_mixes(mixes: dict) -> None:
    throughput, rounds = mixes["throughput"], mixes["rounds"]
    print(f"(4) mixes and scales in the kernel, {CONCURRENCY} concurrent chat x {TOKENS} tokens, through the gateway "
          f"(median of {rounds} rounds)")
    print(f"    {'load':<16}{'tok/s':>9}{'ratio to base':>15}{'engine CPU':>12}{'loads timed':>13}   ratio per round")
    for load, values in throughput.items():
        print(f"    {load:<16}{statistics.median(values['tok_s']):9.1f}{statistics.median(values['ratio']):15.2f}"
              f"{statistics.median(values['cpu_ratio']):12.2f}{max(values['loads'], default=0):13.0f}"
              f"   {_rounds(values['ratio'])}")
    for label, load, against in ((f"{MIXES} / {PLAIN}", MIXES, PLAIN), (f"{SWEPT} / {ONE}", SWEPT, ONE)):
        per_round = [a / b for a, b in zip(throughput[load]["ratio"], throughput[against]["ratio"])]
        cpu = [a / b for a, b in zip(throughput[load]["cpu_ratio"], throughput[against]["cpu_ratio"])]
        ratio = statistics.median(per_round)
        print(f"    {label:<30}{ratio:6.2f}   rounds {_rounds(per_round)}"
              f"   target >= 0.95: {'PASS' if ratio >= 0.95 else 'MISS'}"
              f"   engine CPU {statistics.median(cpu):.2f} ({_rounds(cpu)})")
    print(f"    each mix: two of {MIX_WIDTH} rank-8 adapters, the first at its own scale ({SWEEP[0]} to {SWEEP[-1]})")
    churn, held = mixes["churn"], mixes["held"]
    print(f"    slots meanwhile: {churn['loads']:.0f} adapter loads, {churn['evictions']:.0f} evictions; held after: "
          f"{len(held)} ({sum(':mix.' in name for name in held)} mixes)")
    first = mixes["first"]
    plain, mixed = statistics.median(first["warm adapter"]), statistics.median(first["new mix"])
    print(f"    first request, time to first token, n={len(first['new mix'])} each (median): warm adapter "
          f"{plain:.3f} s, new mix of two warm adapters {mixed:.3f} s ({mixed / plain:.2f}x)"
          f"   target <= 1x: {'PASS' if mixed <= plain else 'MISS'}")
    print("-" * 78)


def report(
    publish: dict[str, list] | None, throughput: dict | None, stock: dict | None, latencies: dict | None,
    mixes: dict | None, catalog_line: str,
) -> None:
    """The table; a section left out of the run (--mix-only) is left out of it."""
    print()
    print("=" * 78)
    print(f"Inference benchmark, {MODEL}, 1 replica; {catalog_line}")
    print(f"machine: {os.cpu_count()} cores, load average now {os.getloadavg()[0]:.1f} (other work included)")
    print("-" * 78)
    if publish is not None:
        _report_publish(publish)
    if throughput is not None:
        _report_throughput(throughput, stock)
    if latencies is not None:
        _report_overhead(latencies)
    if mixes is not None:
        _report_mixes(mixes)
    print("=" * 78)


SECTIONS = ("publish", "throughput", "overhead", "mix")  # each has its --<section>-only


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="throughput rounds (the baseline runs between loads)")
    parser.add_argument(
        "--publishes", type=int, default=10, help="fresh adapters for publish-to-first-token (half preloaded)"
    )
    parser.add_argument("--overhead-samples", type=int, default=100)
    parser.add_argument("--compare-stock", action="store_true", help="also measure throughput on stock vLLM")
    parser.add_argument("--mix-only", action="store_true", help="only (4): mixes and scales, first requests")
    parser.add_argument(
        "--publish-only", action="store_true", help="only (1): publish -> first token, with and without preload"
    )
    parser.add_argument("--throughput-only", action="store_true", help="only (2): throughput over 1 to 1,000 adapters")
    parser.add_argument(
        "--overhead-only", action="store_true", help="only (3): the pool's and the gateway's cost a request"
    )
    parser.add_argument("--model", default=BASE, help=f"a base model of the catalog (default: {BASE})")
    args = parser.parse_args()
    if args.model not in settings.MODEL_CATALOG.ids:
        parser.error(f"--model {args.model!r} is not in the catalog ({', '.join(settings.MODEL_CATALOG.ids)})")
    global MODEL
    MODEL = args.model
    chosen = [section for section in SECTIONS if getattr(args, f"{section}_only")]
    if len(chosen) > 1:
        parser.error("choose one of --mix-only, --publish-only, --throughput-only and --overhead-only")
    sections = set(chosen or SECTIONS)
    if args.compare_stock and "throughput" not in sections:
        parser.error("--compare-stock compares (2), which this choice leaves out")

    logging.getLogger("httpx").setLevel(logging.WARNING)
    print(f"scratch: {SCRATCH}", flush=True)
    call_command("migrate", verbosity=0)
    persona = _persona()
    model = settings.MODEL_CATALOG.require(MODEL)
    maker = AdapterMaker(SCRATCH / "made", MODEL, model.weights)
    print("making adapters ...", flush=True)  # all before the engine starts, which wants both cores
    folders = {f"{MODEL}:bench{i}": maker(seed=100 + i) for i in range(MANY_ADAPTERS)}
    publishes = args.publishes if "publish" in sections else 0
    fresh = [maker(seed=200 + i) for i in range(publishes)]
    held: dict[str, Path] = {}
    if "throughput" in sections:  # the warm tier's load: variants of one adapter, quicker to make
        print(f"making {HELD_ADAPTERS - MANY_ADAPTERS} more adapters ...", flush=True)
        first = next(iter(folders.values()))
        held = {
            f"{MODEL}:held{i}": variant(first, i, SCRATCH / "held" / str(i)) for i in range(MANY_ADAPTERS, HELD_ADAPTERS)
        }
    for name, folder in {**folders, **held}.items():
        publish_fine_tuned_model(persona, name.rpartition(":")[2], folder, MODEL)

    catalog_line = (
        f"dtype {model.engine.dtype}, max_loras {model.engine.max_loras}, max_num_adapters_per_replica "
        f"{model.lora.max_num_adapters_per_replica}, max_lora_rank {model.lora.max_lora_rank}"
    )
    pool_url = settings.INFERENCE_POOL_URL
    publish = throughput = latencies = mixes = None
    with serving(model) as (gateway, replica, pool_process):
        engine = engine_process(pool_process)
        if "publish" in sections:
            print("(1) publish -> first token ...", flush=True)
            publish = publish_to_first_token(persona, fresh, gateway, pool_url)
        if "overhead" in sections:
            print("(3) overhead ...", flush=True)
            adapter = next(iter(folders))
            latencies = {
                "base model": overhead(replica, pool_url, gateway, persona.api_key, MODEL, args.overhead_samples),
                "adapter": overhead(replica, pool_url, gateway, persona.api_key, adapter, args.overhead_samples),
                "base model, a chat with tools": overhead(
                    replica, pool_url, gateway, persona.api_key, MODEL, args.overhead_samples, tools=[WEATHER_TOOL]
                ),
            }
        if "throughput" in sections:
            print("(2) throughput ...", flush=True)
            throughput = throughput_rounds(
                gateway, adapter_loads([*folders, *held]), persona.api_key, args.rounds, engine, pool=pool_url
            )
        if "mix" in sections:
            print("(4) mixes ...", flush=True)
            mixes = mix_section(persona, gateway, pool_url, engine, list(folders), args.rounds)
    stock = None
    if args.compare_stock:
        print("(2) throughput on stock vLLM ...", flush=True)
        stock_folders = {name: adapter_store().fetch(name, SCRATCH) for name in folders}
        stock = stock_vllm_throughput(stock_folders, args.rounds)
    report(publish, throughput, stock, latencies, mixes, catalog_line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
