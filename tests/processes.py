"""Start the platform's real processes for tests, and wait until they answer."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from core.redis_ping import redis_problem
from tests.environment import LANE

ROOT = Path(__file__).resolve().parent.parent
LOGS = LANE.data / "logs"


def answers(url: str, below: int = 300, headers: dict[str, str] | None = None) -> bool:
    """Whether a GET of ``url`` answers within a second with a status under ``below`` (ready: 2xx).
    The pool and its replicas answer only with the internal token in ``headers``."""
    try:
        return httpx.get(url, headers=headers, timeout=1).status_code < below
    except httpx.HTTPError:
        return False


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {process.returncode} (see {LOGS})")
        if condition():
            return
        time.sleep(0.25)
    raise TimeoutError(f"{what}: not ready after {timeout_s:.0f} s (see {LOGS})")


@contextmanager
def running(name: str, command: list[str], env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """Run a command for the duration of the block, its output in LOGS/<name>.log."""
    LOGS.mkdir(parents=True, exist_ok=True)
    with open(LOGS / f"{name}.log", "ab") as log:
        process = subprocess.Popen(
            command, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield process
        finally:
            stop(process)


def stop(process: subprocess.Popen, grace_s: float = 15.0) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, 15)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_web(name: str, env: dict[str, str]) -> Iterator[str]:
    """The web process as the Procfile runs it (Django under uvicorn, ASGI) on a port of its own;
    yields its URL once it answers (a 401 from /v1/models means it is up)."""
    port = free_port()
    command = [
        sys.executable, "-m", "uvicorn", "server.asgi:application", "--app-dir", "platform",
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
    ]
    with running(name, command, env) as process:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: answers(f"{url}/v1/models", below=500), 60, name, process)
        yield url


@contextmanager
def redis_server(port: int, folder):
    """A Redis of the test's own that keeps nothing on disk: stopping it loses every message."""
    command = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(folder)]
    with running(f"redis-{port}", command) as process:
        wait_until(lambda: redis_problem(f"redis://127.0.0.1:{port}/0") is None, 20, "redis", process)
        yield


# For a scenario's own sweeper (``--beat``): it sweeps every few seconds, not every 30, and takes a
# message missing for 10 s as lost, not 60, so a scenario that waits for it (a lost message, a dead
# trainer) waits that much less.
SWEEPS_OFTEN = {"SWEEP_SECONDS": "5", "LOST_MESSAGE_SECONDS": "10"}


def celery_worker_command(queues: str = "default,training", name: str = "test-worker", *extra: str, concurrency: int = 1) -> list[str]:
    return [
        sys.executable, "-m", "celery", "-A", "workers", "worker", "--queues", queues,
        "--concurrency", str(concurrency), "--hostname", f"{name}-{os.getpid()}@%h", "--loglevel", "INFO",
        "--without-mingle", "--without-gossip", *extra,
    ]
