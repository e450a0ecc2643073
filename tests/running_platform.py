"""The platform as a user runs it: ``bin/run`` itself, on its own port, data folder and Redis database.

Nothing here reaches into the processes: tests drive them over HTTP, as a user, the official
``openai`` client, a browser or a load balancer would.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.processes import LOGS, ROOT, answers, free_port, stop, wait_until

# Each variable the platform reads (listed in .env.example) comes from this run, not the caller:
# the test session's own settings (its Redis database, ports, DATABASE_URL) must not leak in.
_PLATFORM_VARIABLES = {
    line.split("=", 1)[0].lstrip("# ").strip()
    for line in (ROOT / ".env.example").read_text().splitlines()
    if re.match(r"^#? ?[A-Z][A-Z0-9_]*=", line)
} | {"DJANGO_SETTINGS_MODULE"}
_API_KEY_LINE = re.compile(r"API key:\s+(sk-\S+)")


@dataclass
class RunningPlatform:
    url: str
    api_key: str
    pool_url: str  # the inference pool's internal address (its /health lists what replicas hold)
    internal_token: str  # what the pool answers to: this run's INTERNAL_TOKEN
    data_dir: Path
    redis_url: str
    process: subprocess.Popen

    def pool_health(self) -> dict:
        return self._from_pool("/health").json()

    def pool_metric(self, name: str) -> float:
        """A series of the pool's Prometheus metrics, summed over its labels (0 when it has none yet)."""
        lines = self._from_pool("/metrics").text.splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith((f"{name}{{", f"{name} ")))

    def _from_pool(self, path: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.internal_token}"}
        return httpx.get(f"{self.pool_url}{path}", headers=headers, timeout=10)

    def sign_in(self, page) -> None:
        """Sign a browser page in to the dashboard as the demo user bin/run creates."""
        page.goto(f"{self.url}/login")
        page.fill("#id_username", "demo")
        page.fill("#id_password", "demo")
        page.click("button[type=submit]")
        page.wait_for_url(re.compile(r"/jobs$"))


def _environment(data_dir: Path, redis_url: str, settings: dict[str, str]) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name not in _PLATFORM_VARIABLES}
    env.update(
        DATA_DIR=str(data_dir),
        REDIS_URL=redis_url,
        WEB_PORT=str(free_port()),
        INFERENCE_POOL_URL=f"http://127.0.0.1:{free_port()}",
        FIRST_REPLICA_PORT=str(free_port()),
        INTERNAL_TOKEN=secrets.token_hex(32),  # as a deployment sets it; the test reads the pool with it
        **settings,
    )
    return env


def _pump(process: subprocess.Popen, log_path: Path, key_found: threading.Event, found: dict) -> None:
    """Copy bin/run's combined log to a file, and pick the API key out of its banner."""
    with open(log_path, "ab") as log:
        for line in process.stdout:
            log.write(line)
            log.flush()
            match = _API_KEY_LINE.search(line.decode(errors="replace"))
            if match and not key_found.is_set():
                found["key"] = match.group(1)
                key_found.set()


def shipped_models(data_dir: Path) -> Path:
    """``data_dir/models`` holding links to the checkout's prepared models, and room for more."""
    models = data_dir / "models"
    models.mkdir(parents=True)
    for entry in (ROOT / "data" / "models").iterdir():
        (models / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    return models


@contextmanager
def bin_run(
    data_dir: Path, redis_url: str, ready_timeout_s: float = 420, settings: dict[str, str] | None = None
) -> Iterator[RunningPlatform]:
    """Start ``bin/run``, wait until ``/healthz`` answers 200, and stop everything it started on exit.
    ``settings``: variables of ``.env.example`` to set, as a user's ``.env`` would.

    The base model is prepared once per checkout (``data/models``): the new data folder links to it,
    as a user's second start would find it (``shipped_models``; a caller that added models of its own
    has called it already).
    """
    if not (data_dir / "models").exists():
        shipped_models(data_dir)
    env = _environment(data_dir, redis_url, settings or {})
    LOGS.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [str(ROOT / "bin" / "run")], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True,
    )
    key_found, found = threading.Event(), {}
    threading.Thread(target=_pump, args=(process, LOGS / "bin-run.log", key_found, found), daemon=True).start()
    url = f"http://127.0.0.1:{env['WEB_PORT']}"
    try:
        wait_until(key_found.is_set, 300, "bin/run's API key banner", process)
        wait_until(lambda: answers(f"{url}/healthz"), ready_timeout_s, "bin/run's /healthz", process)
        yield RunningPlatform(
            url, found["key"], env["INFERENCE_POOL_URL"], env["INTERNAL_TOKEN"], data_dir, redis_url, process
        )
    finally:
        stop(process, grace_s=30)
