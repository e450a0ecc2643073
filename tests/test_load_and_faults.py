"""Faults under load, with real processes: the session's vLLM replica, pool and web gateway.

Streaming chat clients over four adapters and the base model, and API clients creating, listing
and cancelling jobs, while an adapter is republished and then the replica's server is SIGKILLed
(a crash: no shutdown runs). Every request must be answered correctly or refused cleanly
(``tests.load`` says what each means), no job may be lost, and the crashed server's engine process
must not outlive it (it would hold its memory and a core, beside the engine that replaces it).
``benchmarks/load_and_faults.py`` runs the same load at full size (killing the replica's whole
process group) and prints the table; here it is small, so the suite stays short.
"""

# ruff: noqa: F811 (pytest fixtures are imported from tests.inference_fixtures, then named as arguments)
from __future__ import annotations

import asyncio
import os
import signal
import uuid

import httpx
import psutil
import pytest
from django.conf import settings

from tests.inference_fixtures import (  # noqa: F401 (fixtures)
    BASE,
    adapter_store,
    alice,
    gateway,
    internal_headers,
    make_adapter,
    publish_fine_tuned_model,
)
from tests.load import Fault, run_load
from tests.personas import good_dataset
from tests.processes import wait_until

pytestmark = [pytest.mark.engine, pytest.mark.fault, pytest.mark.django_db(transaction=True)]


def _replica() -> dict:
    return httpx.get(f"{settings.INFERENCE_POOL_URL}/health", headers=internal_headers()).json()["replicas"][0]


def _alive(process: psutil.Process) -> bool:
    """Running, not a zombie: an orphan's parent in a container may never reap it."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def no_trainer():
    """The scenario measures the web process and the pool: the jobs its clients create (and cancel)
    must not be trained meanwhile by a trainer an earlier test left running, which would take the
    CPU the engine needs. Trainers stop taking the training queue for the test, then take it again."""
    from base.celery import TRAINING_QUEUE, app

    app.control.cancel_consumer(TRAINING_QUEUE, reply=True, timeout=2)
    yield
    app.control.add_consumer(TRAINING_QUEUE, reply=True, timeout=2)


def test_under_load_every_request_is_answered_or_refused_cleanly_through_a_republish_and_a_replica_kill(
    alice, make_adapter, gateway, no_trainer
):
    names = [publish_fine_tuned_model(alice, f"load{i}-{uuid.uuid4().hex[:6]}", make_adapter(seed=50 + i)) for i in range(4)]
    training_file = alice.client.files.create(file=("train.jsonl", good_dataset(10)), purpose="fine-tune").id
    replica = _replica()
    engines: list[psutil.Process] = []

    def republish_while_streaming() -> None:
        adapter_store().publish(names[0], make_adapter(seed=60))

    def kill_the_replica() -> None:
        engines.extend(psutil.Process(replica["pid"]).children())
        os.kill(replica["pid"], signal.SIGKILL)  # the server alone, as a crash would

    report = asyncio.run(run_load(
        gateway, alice.api_key, [BASE, *names], chat_clients=12, duration_s=30, job_clients=2,
        training_file=training_file,
        faults=[Fault(8, "republish an adapter", republish_while_streaming), Fault(16, "SIGKILL the server", kill_the_replica)],
    ))
    print(report.summary())
    assert report.lost() == [], report.lost()[:5]
    assert report.count("answered") >= 12  # the load ran...
    assert report.count("refused") + report.count("cut") > 0  # ...and the kill was felt, cleanly
    assert report.job_calls["lost"] == 0 and report.jobs_created > 0 and report.lost_jobs == []
    assert engines, "the replica's server had started no engine process"
    wait_until(lambda: not any(map(_alive, engines)), 60, "the crashed server's engine process to stop")
    wait_until(lambda: _replica()["healthy"], 300, "the killed replica to be restarted")
    answer = alice.client.chat.completions.create(model=names[0], messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert answer.choices[0].message.content  # the republished adapter loads on the new engine
