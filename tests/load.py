"""Load with faults: many streaming chat clients and API clients against a running gateway, while
scheduled faults happen, and an account of every request (shared by the suite's fault test and
``benchmarks/load_and_faults.py``).

Each chat request ends one way:
- ``answered``: 200, a well-formed stream of the model asked for, ending in ``[DONE]``;
- ``refused``: 429 or 503 with ``Retry-After`` and an OpenAI-shaped error (a clean "try again");
- ``cut``: the stream had begun and ended with an error event (a replica died under it: the
  answer cannot be un-sent, but the client is told);
- ``lost``: anything else: a hang, a dropped connection, a 500, a stream that just stops.
API clients create a fine-tuning job, list jobs and cancel it, over and over; afterwards every job
they created must be listed and cancelled (``lost_jobs`` counts the others).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

REQUEST_TIMEOUT_S = 180.0
_BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "Name three colours."}]


@dataclass(frozen=True)
class Fault:
    at_s: float  # after the load starts
    name: str
    action: Callable[[], None]  # blocking is fine: it runs in a thread


@dataclass
class Outcome:
    kind: str  # answered, refused, cut, lost
    model: str
    latency_s: float
    first_token_s: float | None = None
    detail: str = ""


@dataclass
class LoadReport:
    outcomes: list[Outcome] = field(default_factory=list)
    jobs_created: int = 0
    job_calls: Counter = field(default_factory=Counter)  # "ok", "refused", "lost"
    lost_jobs: list[str] = field(default_factory=list)
    faults: list[tuple[float, str]] = field(default_factory=list)  # when each happened, and what

    def count(self, kind: str) -> int:
        return sum(1 for outcome in self.outcomes if outcome.kind == kind)

    def latencies(self, first_token: bool = False) -> list[float]:
        answered = [outcome for outcome in self.outcomes if outcome.kind == "answered"]
        return [outcome.first_token_s if first_token else outcome.latency_s for outcome in answered]

    def percentile(self, q: float, first_token: bool = False) -> float:
        values = sorted(self.latencies(first_token))
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(q / 100 * len(values)))]

    def lost(self) -> list[Outcome]:
        return [outcome for outcome in self.outcomes if outcome.kind == "lost"]

    def summary(self) -> str:
        kinds = ", ".join(f"{kind} {self.count(kind)}" for kind in ("answered", "refused", "cut", "lost"))
        refusals = Counter(outcome.detail for outcome in self.outcomes if outcome.kind == "refused")
        return (
            f"{len(self.outcomes)} chats ({kinds}; refused as {dict(refusals)}); p50 {self.percentile(50):.2f} s, p99 {self.percentile(99):.2f} s; "
            f"{self.jobs_created} jobs, calls {dict(self.job_calls)}, lost jobs {len(self.lost_jobs)}"
        )


async def _chat(client: httpx.AsyncClient, gateway: str, headers: dict, model: str, max_tokens: int) -> Outcome:
    body = {"model": model, "messages": QUESTION, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    started = time.perf_counter()
    first_token_s = None

    def outcome(kind: str, detail: str = "") -> Outcome:
        return Outcome(kind, model, time.perf_counter() - started, first_token_s, detail)

    try:
        async with client.stream("POST", f"{gateway}/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                raw = await response.aread()
                return _refusal(response, raw, outcome)
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    return outcome("answered") if first_token_s is not None else outcome("lost", "no token")
                event = json.loads(data)
                if "error" in event:
                    return outcome("cut", event["error"].get("message", "")[:200])
                if str(event.get("model")).partition("@")[0] != model:  # a revision of the model asked for is it
                    return outcome("lost", f"answered by {event.get('model')}")
                if first_token_s is None and any(choice["delta"].get("content") for choice in event["choices"]):
                    first_token_s = time.perf_counter() - started
            return outcome("lost", "the stream stopped without [DONE] or an error event")
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return outcome("lost", repr(exc)[:200])


def _refusal(response: httpx.Response, raw: bytes, outcome) -> Outcome:
    try:
        error = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return outcome("lost", f"{response.status_code} without an OpenAI-shaped body: {raw[:120]!r}")
    if response.status_code in (429, 503) and response.headers.get("retry-after"):
        return outcome("refused", f"{response.status_code} {error.get('code')}")
    return outcome("lost", f"{response.status_code} {error.get('code')}: {str(error.get('message'))[:160]}")


async def _chat_client(client, gateway, headers, models, deadline, max_tokens, report: LoadReport) -> None:
    while time.monotonic() < deadline:
        result = await _chat(client, gateway, headers, random.choice(models), max_tokens)
        report.outcomes.append(result)
        if result.kind != "answered":
            await asyncio.sleep(1.0)  # as a client honouring Retry-After would


async def _job_call(report: LoadReport, request) -> httpx.Response | None:
    try:
        response = await request
    except httpx.HTTPError:
        report.job_calls["lost"] += 1
        return None
    if response.status_code < 300:
        report.job_calls["ok"] += 1
        return response
    refused = response.status_code in (429, 503) and response.headers.get("retry-after")
    report.job_calls["refused" if refused else "lost"] += 1
    return None


async def _job_client(client, gateway, headers, training_file, deadline, report: LoadReport, created: list) -> None:
    while time.monotonic() < deadline:
        body = {"model": _BASE, "training_file": training_file, "suffix": f"load-{random.randrange(1 << 30):x}"}
        response = await _job_call(report, client.post(f"{gateway}/v1/fine_tuning/jobs", json=body, headers=headers))
        await _job_call(report, client.get(f"{gateway}/v1/fine_tuning/jobs?limit=20", headers=headers))
        if response is not None:
            job_id = response.json()["id"]
            created.append(job_id)
            await _job_call(report, client.post(f"{gateway}/v1/fine_tuning/jobs/{job_id}/cancel", headers=headers))
        await asyncio.sleep(1.0)  # a person or a script polling, not a flood


async def _faults(faults: list[Fault], started: float, report: LoadReport) -> None:
    for fault in sorted(faults, key=lambda fault: fault.at_s):
        await asyncio.sleep(max(0.0, started + fault.at_s - time.monotonic()))
        report.faults.append((time.monotonic() - started, fault.name))
        await asyncio.to_thread(fault.action)


async def _account_for_jobs(client, gateway, headers, created: list[str], report: LoadReport) -> None:
    """Every job created is cancelled now (cancelling a queued job is immediate; a running one stops
    at its next step): give them a minute."""
    deadline = time.monotonic() + 60
    pending = list(created)
    while pending and time.monotonic() < deadline:
        still = []
        for job_id in pending:
            response = await client.get(f"{gateway}/v1/fine_tuning/jobs/{job_id}", headers=headers)
            if response.status_code != 200 or response.json()["status"] != "cancelled":
                still.append(job_id)
        pending = still
        if pending:
            await asyncio.sleep(1.0)
    report.lost_jobs = pending


async def run_load(
    gateway: str,
    api_key: str,
    models: list[str],
    *,
    chat_clients: int,
    duration_s: float,
    faults: list[Fault] = (),
    job_clients: int = 0,
    training_file: str | None = None,
    max_tokens: int = 16,
) -> LoadReport:
    report = LoadReport()
    headers = {"Authorization": f"Bearer {api_key}"}
    created: list[str] = []
    limits = httpx.Limits(max_connections=chat_clients + job_clients + 4)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        started = time.monotonic()
        deadline = started + duration_s
        await asyncio.gather(
            *(_chat_client(client, gateway, headers, models, deadline, max_tokens, report) for _ in range(chat_clients)),
            *(_job_client(client, gateway, headers, training_file, deadline, report, created) for _ in range(job_clients)),
            _faults(list(faults), started, report),
        )
        report.jobs_created = len(created)
        await _account_for_jobs(client, gateway, headers, created, report)
    return report
