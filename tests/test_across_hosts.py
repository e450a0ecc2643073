"""Several hosts, played on one machine: a Ray cluster of two nodes serving a model with a replica
on each, and two trainers with data folders of their own, sharing only the database, Redis and an
S3 server (moto's, over HTTP), as docs/serving.md's "Across hosts" runs them.

One scenario, in order: trainer A is killed mid-job (its host gone) and trainer B finishes the job
from A's last checkpoint; the model answers on its first request from a Ray replica, which read
the adapter from S3 (no host's disk holds it for another); the worker node is stopped while
requests keep coming: each answers or is a 503 with Retry-After, and the model keeps answering;
the node comes back and its replica with it. The times are printed.

Slow (two engines and a training job): once per CI run (marker ``fault``). Run it alone with
``bin/test tests/test_across_hosts.py -s``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest
import redis

from core.adapter_store import S3AdapterStore
from inference.ray_serve.cluster import make_private_token
from finetuning.models import JobStatus
from tests.fine_tuning_jobs import wait_for_job
from tests.inference_fixtures import BASE, catalog_text
from tests.personas import good_dataset
from tests.processes import SWEEPS_OFTEN, celery_worker_command, free_port, running, running_web, wait_until
from tests.ray_nodes import ray_node, ready_replicas, stop_node, worker_node_arguments
from tests.s3 import running_s3_server

pytestmark = [pytest.mark.fault, pytest.mark.training, pytest.mark.django_db(transaction=True)]

REDIS_URL = "redis://127.0.0.1:6379/12"  # neither the suite's broker nor the other fault tests'
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

# A replica on each node; a request waits up to 30 s for one to take it.
_CATALOG = catalog_text("ray", replicas=2, autoscaling="min_replicas = 2\ncold_start_wait_s = 30")


def test_two_trainers_and_two_ray_nodes_share_only_the_database_redis_and_s3(
    alice, test_database_url, tmp_path, machine_to_itself
):
    redis.Redis.from_url(REDIS_URL).flushdb()
    catalog = tmp_path / "models.toml"
    catalog.write_text(_CATALOG)
    serve_url = f"http://127.0.0.1:{free_port()}"
    with running_s3_server("fleet") as s3, ExitStack() as stack:
        shared = {
            "DATABASE_URL": test_database_url, "REDIS_URL": REDIS_URL, "MODEL_CATALOG": str(catalog),
            "RAY_SERVE_URL": serve_url, "RAY_AUTH_MODE": "token",
            "FILES_PATH": "s3://fleet/files", "DYNAMIC_LORA_PATH": "s3://fleet/adapters",
            "S3_ENDPOINT_URL": s3.settings.endpoint_url, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
        }
        host = {name: {**shared, "DATA_DIR": str(tmp_path / name)} for name in ("a", "b", "web")}
        for environment in host.values():
            Path(environment["DATA_DIR"]).mkdir()
        # The weights are not the trainers' data: every host has the model (set-up prepares it).
        weights = Path(__file__).resolve().parent.parent / "data" / "models"
        for name in ("a", "b"):
            os.symlink(weights, Path(host[name]["DATA_DIR"]) / "models")
        os.symlink(weights, Path(host["web"]["DATA_DIR"]) / "models")

        # --- two trainers: A dies mid-job, B finishes it from A's checkpoint -------------------
        web = stack.enter_context(running_web("web-hosts", host["web"]))
        headers = {"Authorization": f"Bearer {alice.key}"}
        uploaded = httpx.post(
            f"{web}/v1/files", headers=headers, data={"purpose": "fine-tune"},
            files={"file": ("train.jsonl", good_dataset(10))}, timeout=60,
        )
        assert uploaded.status_code == 200, uploaded.text
        body = {
            "model": BASE,
            "training_file": uploaded.json()["id"],
            "suffix": "fleet",
            "hyperparameters": {"n_epochs": 2, "batch_size": 2},  # A is killed after epoch 1 of 5 steps
        }
        job_id = httpx.post(f"{web}/v1/fine_tuning/jobs", json=body, headers=headers, timeout=60).json()["id"]
        sweeper = celery_worker_command("default", "sweeper-hosts", "--beat", "--schedule", str(tmp_path / "beat"))
        stack.enter_context(running("sweeper-hosts", sweeper, host["web"] | SWEEPS_OFTEN))
        with running("trainer-a", celery_worker_command("training", "trainer-a"), host["a"]) as trainer_a:
            wait_for_job(job_id, lambda job: job.events.filter(message__startswith="Checkpoint saved").exists(), 300)
            os.killpg(trainer_a.pid, signal.SIGKILL)  # the host is gone: the trainer and its child
        killed_at = time.monotonic()
        with running("trainer-b", celery_worker_command("training", "trainer-b"), host["b"]):
            job = wait_for_job(job_id, lambda job: job.is_finished, 480)
        print(f"\ntrainer B finished the job {time.monotonic() - killed_at:.1f} s after trainer A was killed")
        assert job.status == JobStatus.SUCCEEDED and job.attempts == 2, job.error_message
        assert job.events.filter(message__startswith="Resuming after epoch").exists()
        model = job.fine_tuned_model
        assert S3AdapterStore("s3://fleet/adapters", s3.settings).version(model) is not None  # published to S3

        # --- two Ray nodes: the model answers from S3; a node stops, traffic moves --------------
        head_port = free_port()
        make_private_token()  # docs/serving.md's first step on the head: the cluster's token, once
        stack.enter_context(
            ray_node(["--head", f"--port={head_port}", "--num-cpus=1", "--include-dashboard=false"], host["a"])
        )
        worker_node = stack.enter_context(ray_node(worker_node_arguments(head_port), host["b"]))
        launcher = {**host["web"], "RAY_ADDRESS": f"127.0.0.1:{head_port}"}
        serve = stack.enter_context(running("ray-serve-hosts", [sys.executable, "-m", "inference.ray_serve"], launcher))
        wait_until(lambda: ready_replicas(serve_url) == 2, 420, "two Ray replicas, one a node", serve)
        gateway = stack.enter_context(running_web("gateway-hosts", host["web"]))
        client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=alice.key, max_retries=0, timeout=120)
        answer = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0)
        assert answer.model == f"{model}@r1" and answer.choices[0].message.content

        stop_node(worker_node)
        stopped_at, outcomes = time.monotonic(), []  # (seconds after the stop, status, seconds it took)

        def moved() -> bool:
            """Traffic has moved: five answers in a row, and Ray has given the stopped node's replica up."""
            return [status for _, status, _ in outcomes[-5:]] == [200] * 5 and ready_replicas(serve_url) == 1

        while time.monotonic() - stopped_at < 30 and not moved():
            asked = time.monotonic()
            try:
                client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, temperature=0)
                status = 200
            except openai.APIStatusError as exc:
                assert exc.status_code == 503 and exc.response.headers.get("retry-after"), (exc.status_code, exc.body)
                status = 503
            outcomes.append((asked - stopped_at, status, time.monotonic() - asked))
        refused = [at for at, status, _ in outcomes if status == 503]
        slowest = max(took for _, _, took in outcomes)
        print(
            f"node stopped: {len(outcomes)} requests in {time.monotonic() - stopped_at:.0f} s, the slowest answered in {slowest:.2f} s; "
            f"{len(refused)} answered 503 with Retry-After, the last {max(refused, default=0.0):.1f} s after the stop"
        )
        assert [status for _, status, _ in outcomes[-5:]] == [200] * 5  # the model answers on the node left
        assert ready_replicas(serve_url) == 1  # the stopped node's replica is gone: nowhere to place it

        back_at = time.monotonic()
        stack.enter_context(ray_node(worker_node_arguments(head_port), host["b"]))
        wait_until(lambda: ready_replicas(serve_url) == 2, 420, "the second replica back", serve)
        print(f"node back: 2 replicas ready again after {time.monotonic() - back_at:.1f} s")
