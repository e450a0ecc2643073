"""Where a replica's cold start goes: the timeline from the spawn of its process to its first tokens.

    .venv/bin/python benchmarks/cold_start_timeline.py [--rounds 3] [--wakes 5]

Starts one vLLM replica of the repository catalog's first model as the pool starts it
(``inference.replica.vllm_command`` and ``vllm_environment``), reads its output line by line as it
comes and stamps each line with the seconds since the spawn. The milestones are the first lines,
in order, that say a stage is done (vLLM's own log lines and the engine's kernel line); then, from
outside, ``/health`` answering, the first streamed token of a base-model completion, and an
adapter's load and first streamed token. Prints the median over rounds of each milestone's time
since the spawn and of the step from the milestone before; every round's whole output, stamped,
goes to the scratch folder for a closer look.

Then, on the last round's replica, sleep against stop (``idle = "sleep"``, docs/serving.md): the
replica is put to sleep and woken for a streamed request, as the pool does, ``--wakes`` times for the
base model and as many for the adapter; printed: the medians from the wake's request to the first
token, beside the cold start's, and the replica's resident memory (server and engine) awake and
asleep.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]  # the repository's packages, for the imports below
os.environ.setdefault("DEBUG", "true")  # a local measurement: development mode, as bin/run starts it locally
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from core.config import load_config
from core.internal_token import bearer
from inference.engine_contract import SLEEP_PATH, WAKE_PATH
from inference.replica import vllm_command, vllm_environment
from tests.inference_fixtures import AdapterMaker

PORT = 38400
ADAPTER = "cold-start-adapter"
# (milestone, what the first line after the milestone before says when it is reached)
LOGGED = (
    ("the server module imported, kernels decided", r"inference\.engine\.server: .*LoRA kernels"),
    ("vLLM's arguments parsed", r"non-default args"),
    ("the model's config resolved", r"Resolved architecture"),
    ("the engine's process: kernels decided", r"inference\.engine\.server: .*LoRA kernels"),
    ("the engine initialising", r"Initializing a V1 LLM engine"),
    ("weights loaded", r"Loading weights took"),
    ("KV cache sized", r"KV cache size"),
    ("engine initialised (profile, KV cache, warm-up)", r"init engine .* took"),
    ("the server listening", r"Starting vLLM server on"),
)


class StampedOutput:
    """A process's output lines, each with the seconds since ``started`` it arrived at."""

    def __init__(self, process: subprocess.Popen, started: float) -> None:
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(process, started), daemon=True)
        self._thread.start()

    def _read(self, process: subprocess.Popen, started: float) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.lines.append((time.monotonic() - started, line.rstrip()))

    def milestones(self) -> dict[str, float]:
        found: dict[str, float] = {}
        position = 0
        for name, pattern in LOGGED:
            for index in range(position, len(self.lines)):
                if re.search(pattern, self.lines[index][1]):
                    found[name], position = self.lines[index][0], index + 1
                    break
        return found


def _until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def _healthy(url: str, headers: dict[str, str]) -> bool:
    try:
        return httpx.get(f"{url}/health", headers=headers, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _first_streamed_token(url: str, headers: dict[str, str], model: str) -> None:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return
    raise RuntimeError(f"{model} streamed no token")


def _resident_gib(pid: int) -> float:
    """The server's and its engine's memory: proportional set sizes, so the pages the forked engine
    shares with the server count once."""
    server = psutil.Process(pid)
    return sum(process.memory_full_info().pss for process in [server, *server.children(recursive=True)]) / 2**30


def sleep_and_wake(url: str, headers: dict[str, str], pid: int, models: list[str], wakes: int) -> dict[str, list[float]]:
    """Asleep, then woken for each model's streamed request, ``wakes`` times: seconds from the
    request to its first token (the wake included), and the memory awake and asleep."""
    found: dict[str, list[float]] = {"awake GiB": [_resident_gib(pid)], "asleep GiB": []}
    for _ in range(wakes):
        for model in models:
            httpx.post(f"{url}{SLEEP_PATH}", headers=headers, timeout=60).raise_for_status()
            found["asleep GiB"].append(_resident_gib(pid))
            requested = time.monotonic()
            httpx.post(f"{url}{WAKE_PATH}", headers=headers, timeout=60).raise_for_status()
            _first_streamed_token(url, headers, model)
            found.setdefault(model, []).append(time.monotonic() - requested)
    return found


def one_round(model, api_key: str, adapter: Path, log: Path, wakes: int = 0) -> dict[str, float]:
    url, headers = f"http://127.0.0.1:{PORT}", {"Authorization": bearer(api_key)}
    started = time.monotonic()
    process = subprocess.Popen(
        vllm_command(model, PORT), cwd=ROOT, env=vllm_environment(model, api_key), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    output = StampedOutput(process, started)
    try:
        _until(lambda: _healthy(url, headers) or process.poll() is not None, 600, "the replica's /health")
        if process.poll() is not None:
            raise RuntimeError(f"the replica exited with {process.returncode}: see {log}")
        seen = {"/health answers": time.monotonic() - started}
        _first_streamed_token(url, headers, model.id)
        seen["the base model's first streamed token"] = time.monotonic() - started
        loaded = httpx.post(f"{url}/v1/load_lora_adapter", headers=headers, timeout=120,
                            json={"lora_name": ADAPTER, "lora_path": str(adapter)})
        loaded.raise_for_status()
        seen["an adapter loaded"] = time.monotonic() - started
        _first_streamed_token(url, headers, ADAPTER)
        seen["the adapter's first streamed token"] = time.monotonic() - started
        if wakes:
            for name, values in sleep_and_wake(url, headers, process.pid, [model.id, ADAPTER], wakes).items():
                seen[f"wake: {name}"] = statistics.median(values)
        return {**output.milestones(), **seen}
    finally:
        os.killpg(process.pid, 15)
        process.wait(30)
        log.write_text("\n".join(f"{at:8.3f}  {line}" for at, line in output.lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--wakes", type=int, default=5, help="sleeps and wakes per model on the last round's replica")
    args = parser.parse_args()
    config = load_config()
    model = config.catalog().models[0]
    scratch = Path(tempfile.mkdtemp(prefix="fineserve-cold-start-"))
    adapter = AdapterMaker(scratch)(seed=1)
    rounds = []
    for number in range(1, args.rounds + 1):
        wakes = args.wakes if number == args.rounds else 0
        rounds.append(one_round(model, config.internal_token, adapter, scratch / f"round-{number}.log", wakes))
        print(f"  round {number}: ready in {rounds[-1]['/health answers']:.1f} s", flush=True)

    names = [name for name, _ in LOGGED] + [
        name for name in rounds[0] if name not in dict(LOGGED) and not name.startswith("wake: ")
    ]
    print(f"\n{model.id}, {args.rounds} rounds (medians); each round's output, stamped: {scratch}")
    print(f"{'milestone':<52}{'s since spawn':>15}{'step s':>9}")
    before = 0.0
    for name in names:
        times = [found[name] for found in rounds if name in found]
        if not times:
            print(f"{name:<52}{'-':>15}{'-':>9}")
            continue
        at = statistics.median(times)
        print(f"{name:<52}{at:>15.2f}{at - before:>9.2f}")
        before = at
    woken = rounds[-1]
    if "wake: asleep GiB" in woken:
        cold = rounds[-1]["the base model's first streamed token"]
        print(f"\nsleep against stop, {args.wakes} wakes per model (medians): from the request to the first streamed token")
        print(f"{'':<40}{'woken s':>9}{'started s':>11}{'ratio':>8}")
        for model_name, label in ((model.id, "the base model"), (ADAPTER, "the adapter")):
            started_s = cold if model_name == model.id else rounds[-1]["the adapter's first streamed token"]
            print(f"{label:<40}{woken[f'wake: {model_name}']:>9.2f}{started_s:>11.2f}{started_s / woken[f'wake: {model_name}']:>8.0f}x")
        print(f"the replica's memory: {woken['wake: awake GiB']:.2f} GiB awake, {woken['wake: asleep GiB']:.2f} GiB asleep")
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} (other work included)")


if __name__ == "__main__":
    main()
