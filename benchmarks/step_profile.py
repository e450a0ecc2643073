"""Where a decode step's time goes, for the base model and for many adapters in round robin.

    .venv/bin/python benchmarks/step_profile.py [--adapters 64] [--seconds 20] [--rounds 2] [--keep DIR]

Starts the benchmark's pool and gateway (``benchmarks/inference_bench.py``: one vLLM CPU replica,
the catalog's default model, random rank-8 adapters), keeps CONCURRENCY requests in flight (each
TOKENS tokens, the next sent as one ends), and samples the engine's process with py-spy
(``--nonblocking``: the engine is never paused, so the sampled run keeps its speed) while the load
runs: first the base model alone, then ``--adapters`` adapters in round robin, alternately for
``--rounds``. The engine's generated tokens over each window (vLLM's own counter) turn the samples
into milliseconds per CONCURRENCY generated tokens, one decode step's worth at that concurrency, so
the two loads' steps can be set side by side: where the adapters' extra milliseconds go, by part
(``PARTS``), and the functions that gained most. ``--keep DIR`` keeps py-spy's raw stacks. py-spy
comes with the bench extra (``pip install -c constraints.txt ".[bench]"``). Sampled, the engine runs
slower than alone (py-spy takes a share of the two cores): read the parts against each other and
the base model's, and take throughput from ``inference_bench.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from inference_bench import (  # also sets up Django and the scratch space, as the benchmark does
    CONCURRENCY,
    INTERNAL,
    MODEL,
    SCRATCH,
    AdapterMaker,
    _persona,
    _request_body,
    engine_process,
    publish_fine_tuned_model,
    serving,
    settings,
)

import httpx
import psutil

# The parts of a step, each by the functions that mark it (py-spy's frame names), the first that
# matches from the innermost frame outwards. Past them, the rest of the model's forward pass is the
# base model's own work, and the rest of the engine's busy time its scheduling and bookkeeping.
PARTS: dict[str, tuple[str, ...]] = {
    "LoRA: projections (our kernel)": ("_add_lora_linear", "add_lora_linear"),
    "LoRA: logits and embeddings (vLLM's)": ("_add_lora_logits", "add_lora_logits", "add_lora_embedding"),
    "LoRA: slot swaps": ("activate_adapter", "set_lora", "reset_lora", "copy_slots", "to_half_slots"),
    "LoRA: step's adapters and mapping": (
        "set_active_adapters",
        "update_metadata",
        "add_adapter",
        "_apply_adapters",
        "_set_adapter_mapping",
        "convert_mapping",
        "set_active_loras",
    ),
    "model forward (base)": ("forward",),
    "sampling": ("sample", "compute_logits"),
}
OTHER = "engine: scheduling, inputs, outputs"


def drive(gateway: str, api_key: str, targets: list[dict], stop: threading.Event) -> None:
    """CONCURRENCY requests in flight over ``targets`` in round robin until ``stop`` is set."""
    headers = {"Authorization": f"Bearer {api_key}"}

    async def worker(client: httpx.AsyncClient, first: int) -> None:
        index = first
        while not stop.is_set():
            body = _request_body(targets[index % len(targets)], "completions")
            (await client.post(f"{gateway}/v1/completions", json=body, headers=headers)).raise_for_status()
            index += CONCURRENCY

    async def all_workers() -> None:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=2 * CONCURRENCY)) as client:
            await asyncio.gather(*(worker(client, first) for first in range(CONCURRENCY)))

    asyncio.run(all_workers())


def warm_up(gateway: str, api_key: str, targets: list[dict]) -> None:
    """One token from each target: every adapter loaded before the samples are taken."""
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(timeout=600) as client:
        for target in targets:
            body = {**_request_body(target, "completions"), "max_tokens": 1, "min_tokens": 1}
            client.post(f"{gateway}/v1/completions", json=body, headers=headers).raise_for_status()


def generated_tokens(replica: str) -> float:
    """vLLM's count of tokens generated so far on the replica."""
    text = httpx.get(f"{replica}/metrics", headers=INTERNAL, timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:generation_tokens_total")
    )


def sample(engine: psutil.Process, seconds: float, rate: int, out: Path) -> None:
    subprocess.run(
        [shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy")), "record", "--nonblocking",
         "--threads", "-p", str(engine.pid), "-d", str(int(seconds)), "-r", str(rate), "-f", "raw", "-o", str(out)],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


def _function(frame: str) -> str:
    """A py-spy frame's function name, without its class: ``Class.method (file.py:12)`` -> ``method``."""
    return frame.split(" (")[0].rpartition(".")[2]


def part_of(frames: list[str]) -> str:
    """The step's part a stack of the engine's main thread (outermost frame first) was sampled in."""
    functions = [_function(frame) for frame in frames]
    for function in reversed(functions):
        for part, markers in PARTS.items():
            if function in markers:
                return part
    return OTHER


def read_stacks(path: Path) -> tuple[Counter[str], Counter[str]]:
    """Over the engine's main thread (where vLLM's CPU engine steps): samples per part, and samples
    per function (inclusive, once a stack)."""
    parts: Counter[str] = Counter()
    functions: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        thread, *frames = stack.split(";")
        if not thread.endswith(": MainThread") or not frames:
            continue
        count = int(count_text)
        parts[part_of(frames)] += count
        for name in {frame.split(" (")[0] for frame in frames}:
            functions[name] += count
    return parts, functions


def profile(load: str, gateway: str, api_key: str, targets: list[dict], replica: str, engine: psutil.Process,
            seconds: float, rate: int, keep: Path) -> dict:
    warm_up(gateway, api_key, targets)
    stop = threading.Event()
    driver = threading.Thread(target=drive, args=(gateway, api_key, targets, stop), daemon=True)
    driver.start()
    time.sleep(10)  # the batch full
    before, started = generated_tokens(replica), time.perf_counter()
    out = keep / f"{load.replace(' ', '-')}-{int(started)}.txt"
    sample(engine, seconds, rate, out)
    tokens, elapsed = generated_tokens(replica) - before, time.perf_counter() - started
    stop.set()
    driver.join()
    parts, functions = read_stacks(out)
    # a sample stands for 1/rate seconds of the engine's work (py-spy leaves out a thread waiting for
    # work); a decode step at CONCURRENCY in flight makes CONCURRENCY tokens
    per_step = 1000 / rate * CONCURRENCY / tokens
    return {
        "tok_s": tokens / elapsed,
        "step_ms": 1000 * elapsed * CONCURRENCY / tokens,
        "parts": {part: count * per_step for part, count in parts.items()},
        "functions": {function: count * per_step for function, count in functions.items()},
    }


def _adapters(count: int) -> str:
    return f"{count} adapter{'s' if count > 1 else ''}"


def _median(runs: list[dict], key: str, name: str) -> float:
    return statistics.median(run[key].get(name, 0.0) for run in runs)


def report(runs: dict[str, list[dict]], adapters: int) -> None:
    base, many = runs["base model"], runs[_adapters(adapters)]
    print()
    print("=" * 78)
    print(f"A decode step's time (ms per {CONCURRENCY} generated tokens), {MODEL}; median of {len(base)} round(s)")
    print(f"{'part':<42}{'base model':>12}{_adapters(adapters):>14}{'difference':>11}")
    print("-" * 78)
    names = [*PARTS, OTHER]
    for name in names:
        b, m = _median(base, "parts", name), _median(many, "parts", name)
        print(f"{name:<42}{b:>12.1f}{m:>14.1f}{m - b:>+11.1f}")
    busy_b = sum(_median(base, "parts", name) for name in names)
    busy_m = sum(_median(many, "parts", name) for name in names)
    print(f"{'engine busy, sampled':<42}{busy_b:>12.1f}{busy_m:>14.1f}{busy_m - busy_b:>+11.1f}")
    step_b, step_m = (
        statistics.median(run["step_ms"] for run in base),
        statistics.median(run["step_ms"] for run in many),
    )
    print(f"{'a step, by the tokens generated':<42}{step_b:>12.1f}{step_m:>14.1f}{step_m - step_b:>+11.1f}")
    tok_b = sorted(run["tok_s"] for run in base)
    tok_m = sorted(run["tok_s"] for run in many)
    print(f"{'tokens per second (each round)':<42}{', '.join(f'{t:.0f}' for t in tok_b):>12}"
          f"{', '.join(f'{t:.0f}' for t in tok_m):>14}")
    print("-" * 78)
    print("the functions that gained most (inclusive ms per step):")
    # the engine's loop and the model's forward pass hold nearly every sample: leave out what holds most
    busiest = 0.5 * busy_m
    every = {name for run in many for name, ms in run["functions"].items() if ms < busiest}
    gained = sorted(every, key=lambda f: _median(base, "functions", f) - _median(many, "functions", f))
    for function in gained[:15]:
        b, m = _median(base, "functions", function), _median(many, "functions", function)
        print(f"  {function:<40}{b:>12.1f}{m:>14.1f}{m - b:>+11.1f}")
    print("=" * 78)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=64, help="adapters in round robin (default 64)")
    parser.add_argument("--seconds", type=float, default=20, help="py-spy's window per load and round")
    parser.add_argument("--rate", type=int, default=100, help="py-spy's samples per second")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="a folder to keep py-spy's raw stacks in")
    args = parser.parse_args()
    keep = args.keep or SCRATCH / "stacks"
    keep.mkdir(parents=True, exist_ok=True)

    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    persona = _persona()
    model = settings.MODEL_CATALOG.require(MODEL)
    maker = AdapterMaker(SCRATCH / "made", MODEL, model.weights)
    print(f"making {args.adapters} adapters ...", flush=True)
    names = [publish_fine_tuned_model(persona, f"step{i}", maker(seed=100 + i), MODEL) for i in range(args.adapters)]
    loads = {"base model": [{"model": MODEL}], _adapters(args.adapters): [{"model": name} for name in names]}
    runs: dict[str, list[dict]] = {load: [] for load in loads}
    with serving(model) as (gateway, replica, pool_process):
        engine = engine_process(pool_process)
        for round_number in range(args.rounds):
            for load, targets in loads.items():
                run = profile(load, gateway, persona.api_key, targets, replica, engine, args.seconds, args.rate, keep)
                runs[load].append(run)
                print(f"  round {round_number + 1}: {load:<12} {run['tok_s']:7.1f} tok/s", flush=True)
    report(runs, args.adapters)
    print(f"raw stacks: {keep}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
