"""/v1/models with many fine-tuned models: how long the listing takes as an organization's models grow.

    .venv/bin/python benchmarks/models_list_bench.py [--requests 30]

On a scratch SQLite database, one organization gets 0, then 100, then 1,000 fine-tuned models (every
other one continued from the one before, so lineages have parents and ancestors to read), and
``GET /v1/models`` is timed through Django (the gateway's view, with its API-key check). It prints
the median per size and its ratio to the empty listing measured in the same run; the target
(issue 13) is under 100 ms with 1,000 models.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "platform")]
SCRATCH = Path(tempfile.mkdtemp(prefix="fineserve-models-bench-"))
os.environ["DATABASE_URL"] = f"sqlite:///{SCRATCH / 'bench.sqlite3'}"
os.environ["DYNAMIC_LORA_PATH"] = str(SCRATCH / "adapters")
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "server.settings")
os.environ.setdefault("DEBUG", "true")

import django

django.setup()

from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client

from accounts.services import create_api_key, create_organization
from finetuning.models import FineTunedModel, FineTuningJob, ModelRevision

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
SIZES = (0, 100, 1000)
TARGET_MS = 100.0


def grow(organization, start: int, stop: int) -> None:
    """Models ``start`` to ``stop - 1``, as succeeded jobs leave them; odd ones continue the one before."""
    jobs = FineTuningJob.objects.bulk_create(
        FineTuningJob(
            organization=organization, model=BASE, training_file="file-bench", suffix=f"m{i}", seed=0, hyperparameters={},
            status="succeeded", parent_model=f"{BASE}:m{i - 1}" if i % 2 else None, fine_tuned_model=f"{BASE}:m{i}",
        )
        for i in range(start, stop)
    )
    models = FineTunedModel.objects.bulk_create(
        FineTunedModel(name=f"{BASE}:m{i}", organization=organization, job=job, base_model=BASE, suffix=f"m{i}")
        for i, job in zip(range(start, stop), jobs)
    )
    ModelRevision.objects.bulk_create(ModelRevision(model=model, number=1, job=model.job) for model in models)


def median_ms(client: Client, key: str, requests: int) -> tuple[float, int]:
    times = []
    for _ in range(requests):
        started = time.perf_counter()
        response = client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {key}")
        times.append(time.perf_counter() - started)
        assert response.status_code == 200, response.content[:200]
    return statistics.median(times) * 1000, len(response.json()["data"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=30, help="timed requests per size")
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    user = User.objects.create_user("bench", "bench@example.com", "bench")
    organization = create_organization("Benchmark", user)
    _, key = create_api_key(organization, user, "bench")
    client = Client()
    rows, registered = [], 0
    for size in SIZES:
        grow(organization, registered, size)
        registered = size
        rows.append((size, *median_ms(client, key, args.requests)))
    baseline = rows[0][1]
    print()
    print("=" * 66)
    print(f"/v1/models, median of {args.requests} requests, machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    print("-" * 66)
    print(f"{'fine-tuned models':>18} {'listed':>8} {'median ms':>10} {'x empty':>8}")
    for size, ms, listed in rows:
        print(f"{size:>18} {listed:>8} {ms:>10.1f} {ms / baseline:>8.1f}")
    verdict = "PASS" if rows[-1][1] < TARGET_MS else "MISS"
    print(f"target: under {TARGET_MS:.0f} ms with {SIZES[-1]} models: {verdict}")
    print("=" * 66)
    return 0


if __name__ == "__main__":
    sys.exit(main())
