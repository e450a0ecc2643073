"""Load and faults, measured on ``bin/run``'s own processes: does every request get an answer or a
clean refusal, and is any job lost, while parts of the platform fail?

    .venv/bin/python benchmarks/load_and_faults.py [--clients 50] [--seconds 60] [--rounds 1]

Starts bin/run (own data folder, ports and Redis database; heartbeats every 2 s, a job silent for
10 s given up on), trains four adapters through the API, then runs the same load in each scenario:
``--clients`` streaming chat clients spread over the four adapters and the base model, and four API
clients creating, listing and cancelling jobs, for ``--seconds``:
- steady: no fault (the baseline the others are compared with, in the same run);
- republish: an adapter republished three times while it streams;
- replica SIGKILL: the vLLM replica killed once (the pool restarts it; one replica, so requests
  are refused until it is back);
- trainer SIGKILL: a real job is trained meanwhile, and the trainer's worker process is killed in
  the middle of a step; only the scheduled sweeper (Celery beat) may recover it.
Prints one table: per scenario the faults tried, requests answered / refused / cut / lost, jobs
lost, and p50/p99 latency of answered chats with their ratio to the steady run.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "platform")]
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "server.settings")
os.environ.setdefault("DEBUG", "true")  # a local measurement: development mode, as bin/run starts it locally

import django  # noqa: E402

django.setup()  # the test helpers it borrows import Django models

import openai  # noqa: E402
import psutil  # noqa: E402
import redis  # noqa: E402

from core.adapter_store import LocalAdapterStore  # noqa: E402
from tests.load import Fault, LoadReport, run_load  # noqa: E402
from tests.personas import good_dataset  # noqa: E402
from tests.processes import wait_until  # noqa: E402
from tests.running_platform import RunningPlatform, bin_run  # noqa: E402

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
REDIS_URL = "redis://127.0.0.1:6379/9"  # no test uses it
FINISHED = ("succeeded", "failed", "cancelled")


def _client(platform: RunningPlatform) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{platform.url}/v1", api_key=platform.api_key, max_retries=0, timeout=120)


def _wait_for_job(client: openai.OpenAI, job_id: str, statuses: tuple[str, ...], timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while (job := client.fine_tuning.jobs.retrieve(job_id)).status not in statuses:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{job_id} is still {job.status} after {timeout_s:.0f} s")
        time.sleep(0.5)
    return job


def train_adapters(platform: RunningPlatform, training_file: str, count: int) -> list[str]:
    client = _client(platform)
    jobs = [
        client.fine_tuning.jobs.create(
            model=BASE, training_file=training_file, suffix=f"load-{index}", hyperparameters={"n_epochs": 1}
        )
        for index in range(count)
    ]
    names = []
    for job in jobs:
        finished = _wait_for_job(client, job.id, FINISHED, 900)
        assert finished.status == "succeeded", finished.error
        names.append(finished.fine_tuned_model)
    return names


def _replica(platform: RunningPlatform) -> dict:
    return platform.pool_health()["replicas"][0]


def _training_child(platform: RunningPlatform) -> psutil.Process:
    """bin/run's trainer's prefork child (the process that runs the task): what an OOM kill would take."""
    for process in psutil.Process(platform.process.pid).children(recursive=True):
        if "--queues training" in " ".join(process.cmdline()) and process.children():
            return process.children()[0]
    raise LookupError("bin/run has no trainer child process")


class TrainerKill:
    """Start a real job, and SIGKILL the trainer's child once the job has reported a step."""

    def __init__(self, platform: RunningPlatform, training_file: str):
        self.platform, self.client, self.training_file = platform, _client(platform), training_file
        self.job_id = ""

    def __call__(self) -> None:
        job = self.client.fine_tuning.jobs.create(
            model=BASE, training_file=self.training_file, suffix="killed-trainer", hyperparameters={"n_epochs": 3}
        )
        self.job_id = job.id
        wait_until(
            lambda: any("Step" in event.message for event in self.client.fine_tuning.jobs.list_events(job.id).data),
            300, "a training step",
        )
        _training_child(self.platform).send_signal(signal.SIGKILL)

    def outcome(self) -> str:
        job = _wait_for_job(self.client, self.job_id, FINISHED, 600)
        events = [event.message for event in self.client.fine_tuning.jobs.list_events(self.job_id, limit=100).data]
        recovered = sum("stopped responding" in message for message in events)
        return f"the killed job {job.status} after {recovered} recovery by the sweeper"


def scenarios(platform: RunningPlatform, adapters: list[str], training_file: str, seconds: float):
    store = LocalAdapterStore(platform.data_dir / "adapters")

    def republish() -> None:
        folder = store.path(adapters[0]).resolve()
        with tempfile.TemporaryDirectory() as copy:
            for file in folder.iterdir():
                (Path(copy) / file.name).write_bytes(file.read_bytes())
            store.publish(adapters[0], Path(copy))

    def kill_replica() -> None:
        os.killpg(_replica(platform)["pid"], signal.SIGKILL)

    trainer_kill = TrainerKill(platform, training_file)
    return [
        ("steady", [], None),
        ("republish", [Fault(seconds * f, "republish", republish) for f in (0.25, 0.5, 0.75)], None),
        ("replica SIGKILL", [Fault(seconds / 2, "replica SIGKILL", kill_replica)], None),
        ("trainer SIGKILL", [Fault(1, "trainer SIGKILL", trainer_kill)], trainer_kill),
    ]


def _row(name: str, report: LoadReport, steady: LoadReport | None, note: str) -> str:
    p50, p99 = report.percentile(50), report.percentile(99)
    ratio = f"{p50 / steady.percentile(50):.2f}x / {p99 / steady.percentile(99):.2f}x" if steady else "1.00x / 1.00x"
    counts = " | ".join(str(report.count(kind)) for kind in ("answered", "refused", "cut", "lost"))
    jobs = f"{report.jobs_created} ({report.job_calls['refused']} refused, {report.job_calls['lost']} lost calls)"
    return (
        f"| {name} | {len(report.faults)} | {len(report.outcomes)} | {counts} | {jobs} | {len(report.lost_jobs)} "
        f"| {p50:.2f} / {p99:.2f} | {ratio} | {note} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()

    logging.getLogger("httpx").setLevel(logging.WARNING)
    redis.Redis.from_url(REDIS_URL).flushdb()
    data_dir = Path(tempfile.mkdtemp(prefix="fineserve-load-"))
    settings = {"JOB_HEARTBEAT_SECONDS": "2", "JOB_STALE_AFTER_SECONDS": "10"}
    print(f"starting bin/run in {data_dir} ...", flush=True)
    with bin_run(data_dir, REDIS_URL, settings=settings) as platform:
        client = _client(platform)
        training_file = client.files.create(file=("train.jsonl", good_dataset(10)), purpose="fine-tune").id
        print("training 4 adapters ...", flush=True)
        adapters = train_adapters(platform, training_file, 4)
        rows = []
        for round_number in range(args.rounds):
            steady = None
            for name, faults, follow_up in scenarios(platform, adapters, training_file, args.seconds):
                print(f"round {round_number + 1}: {name} ...", flush=True)
                report = asyncio.run(run_load(
                    platform.url, platform.api_key, [BASE, *adapters], chat_clients=args.clients,
                    duration_s=args.seconds, faults=faults, job_clients=4, training_file=training_file,
                ))
                note = follow_up.outcome() if follow_up else ""
                rows.append(_row(name, report, steady, note))
                print(rows[-1], flush=True)
                steady = steady or report
                for lost in report.lost()[:3]:
                    print(f"  lost: {lost}", flush=True)
                wait_until(lambda: _replica(platform)["healthy"], 600, "the replica")
    print(f"\n{args.clients} streaming chat clients (16 tokens each) over 4 adapters and the base model, "
          f"and 4 job API clients, for {args.seconds:.0f} s per scenario:\n")
    print("| scenario | faults | chats | answered | refused | cut | lost | jobs created | jobs lost "
          "| p50 / p99 s | vs steady | note |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
