"""Replica benchmark: vLLM's default CPU process layout against the pool's one-process engine.

    .venv/bin/python benchmarks/replica_start.py [--rounds 2]

Starts one vLLM replica of the repository catalog's first model at a time, alternating the two
layouts each round (``inference.replica.vllm_environment(one_process_engine=...)``), and measures
1. start: process launch to ``/health`` answering 200;
2. throughput: CONCURRENCY completions of TOKENS tokens at once, tokens per second;
3. single stream: one completion of TOKENS tokens, tokens per second (what a playground user sees).
Prints the medians over rounds and the ratios of ours to vLLM's default, measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]  # the repository's packages, for the imports below
os.environ.setdefault("DEBUG", "true")  # a local measurement: development mode, as bin/run starts it locally

from core.config import load_config
from core.internal_token import bearer
from inference.replica import vllm_command, vllm_environment
from tests.processes import answers, running, wait_until

CONCURRENCY = 32
TOKENS = 64
PORT = 38300
LAYOUTS = {"vLLM default (engine + worker process)": False, "ours (one-process engine)": True}


def _complete(url: str, headers: dict[str, str], model_id: str, prompt: str) -> int:
    body = {"model": model_id, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=600)
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"]


def measure(model, one_process_engine: bool, api_key: str) -> dict[str, float]:
    url = f"http://127.0.0.1:{PORT}"
    headers = {"Authorization": bearer(api_key)}  # a replica answers only the pool's token
    started = time.monotonic()
    environment = vllm_environment(model, api_key, one_process_engine=one_process_engine)
    with running("bench-replica", vllm_command(model, PORT), environment) as process:
        wait_until(lambda: answers(f"{url}/health", headers=headers), 600, "replica", process)
        ready_s = time.monotonic() - started
        _complete(url, headers, model.id, "Warm up.")
        began = time.monotonic()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            stories = pool.map(lambda i: _complete(url, headers, model.id, f"Story number {i}:"), range(CONCURRENCY))
            tokens = sum(stories)
        throughput = tokens / (time.monotonic() - began)
        began = time.monotonic()
        single = _complete(url, headers, model.id, "Once upon a time") / (time.monotonic() - began)
    return {"start s": ready_s, f"{CONCURRENCY}-way tokens/s": throughput, "single tokens/s": single}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    config = load_config()
    model = config.catalog().models[0]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in LAYOUTS}
    for round_number in range(1, args.rounds + 1):
        for name, one_process in LAYOUTS.items():
            results[name].append(measure(model, one_process, config.internal_token))
            print(f"  round {round_number}: {name}: {results[name][-1]}", flush=True)

    columns = list(results[next(iter(LAYOUTS))][0])
    medians = {name: {c: statistics.median(r[c] for r in runs) for c in columns} for name, runs in results.items()}
    print()
    print(f"{'layout (median of ' + str(args.rounds) + ' rounds)':<42}" + "".join(f"{c:>20}" for c in columns))
    for name, values in medians.items():
        print(f"{name:<42}" + "".join(f"{values[c]:>20.1f}" for c in columns))
    baseline, ours = medians.values()
    print(f"{'ours / default':<42}" + "".join(f"{ours[c] / baseline[c]:>19.2f}x" for c in columns))


if __name__ == "__main__":
    main()
