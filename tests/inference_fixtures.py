"""Fixtures for the inference tests: the test model catalog, the web gateway, personas, adapters.

Import the fixtures in a test module (``from tests.inference_fixtures import *``). The pool itself
is conftest's ``inference_pool`` (one per session), started with ``pool_environment()``.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tests.environment import LANE, ROOT

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
TEST_CATALOG = LANE.data / "inference-models.toml"
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

def catalog_text(
    backend: str = "embedded", replicas: int = 1, autoscaling: str = "", adapters: int = 3, organization_share: float = 1.0
) -> str:
    """The repository catalog's model with a small adapter cache, so eviction shows with a few
    adapters; ``autoscaling``: the lines of its ``[models.autoscaling]`` table; ``adapters``: its
    max_num_adapters_per_replica (and max_loras)."""
    text = f"""
[[models]]
id = "{BASE}"
backend = "{backend}"
weights = "models/{BASE}"
replicas = {replicas}

[models.tools]  # the template set-up installed in the weights folder renders them in this form
parser = "hermes"

[models.lora_config]
max_num_adapters_per_replica = {adapters}
max_lora_rank = 16
organization_share = {organization_share}

[models.engine]
max_model_len = 2048
dtype = "float32"
max_loras = {adapters}
kv_cache_space_gib = 0.25
"""
    return text + (f"\n[models.autoscaling]\n{autoscaling}\n" if autoscaling else "")


def kernels_for(model: str, catalog: Path, data_dir: Path) -> tuple[str, bool]:
    """The LoRA kernels a replica of ``model`` must say it runs, and whether it computes mixes: ours
    for a model in float32, vLLM's own in another dtype (``add_base_model`` picks bfloat16 on a CPU
    with native bf16), where the pool builds mixes as adapters."""
    from core.catalog import load_catalog
    from inference.engine_contract import KERNEL_DTYPES

    dtype = load_catalog(catalog, data_dir, "").require(model).engine.dtype
    return ("fineserve", True) if dtype in KERNEL_DTYPES else ("stock", False)


def pool_environment() -> dict[str, str]:
    """Environment for the test session's pool (and gateway): the test catalog."""
    TEST_CATALOG.parent.mkdir(parents=True, exist_ok=True)
    # The whole replica for each organization (organization_share 1, the default here): every test's
    # personas are new organizations on the one engine of the session, and a test's adapters must
    # not depend on what earlier tests left loaded. (tests/test_adapter_fair_use*.py check the share.)
    TEST_CATALOG.write_text(catalog_text())
    return {"MODEL_CATALOG": str(TEST_CATALOG)}


def internal_headers() -> dict[str, str]:
    """What the pool and its replicas require; the test processes derive the same internal token."""
    from django.conf import settings

    return {"Authorization": f"Bearer {settings.INTERNAL_TOKEN}"}


def monitoring_headers() -> dict[str, str]:
    """What opens /metrics and the detail of /healthz."""
    from django.conf import settings

    return {"Authorization": f"Bearer {settings.MONITORING_TOKEN}"}


@pytest.fixture
def gateway(_gateway_web, inference_pool) -> str:
    """The web process (Django under uvicorn, ASGI) on the test database, in front of the running
    pool (conftest's ``_gateway_web``, one per session)."""
    return _gateway_web


# --- personas ----------------------------------------------------------------------------------


@dataclass
class Persona:
    organization: object
    api_key: str
    client: openai.OpenAI


def _persona(name: str, gateway: str) -> Persona:
    from accounts.services import create_api_key, create_organization
    from django.contrib.auth.models import User

    user = User.objects.create_user(name, f"{name}@example.com", "password")
    organization = create_organization(f"{name.title()}'s lab", user)
    _, raw_key = create_api_key(organization, user, "tests")
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=raw_key, max_retries=0, timeout=180)
    return Persona(organization, raw_key, client)


@pytest.fixture
def alice(transactional_db, gateway) -> Persona:
    """Owns fine-tuned models."""
    return _persona("alice", gateway)


@pytest.fixture
def charlie(transactional_db, gateway) -> Persona:
    """An outsider: alice's models are 404 to him."""
    return _persona("charlie", gateway)


# --- adapters ----------------------------------------------------------------------------------


class AdapterMaker:
    """Random (not zero-initialised) LoRA adapters on a base model (the catalog's first, or ``base``
    with its weights in ``weights``), so each answers differently. An adapter is a function of its
    seed and rank: each is made once a session, and the base model it is made on is loaded for that
    and let go, not held by the test process for the session."""

    def __init__(self, folder: Path, base: str = BASE, weights: Path | None = None):
        self.folder, self.base = folder, base
        self.weights = weights or ROOT / "data" / "models" / base
        self._lock = threading.Lock()

    def __call__(self, seed: int, rank: int = 8) -> Path:
        out = self.folder / f"seed{seed}-r{rank}"
        with self._lock:
            if not (out / "adapter_config.json").exists():
                self._make(out, seed, rank)
        return out

    def _make(self, out: Path, seed: int, rank: int) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(self.weights, dtype=torch.float32)
        torch.manual_seed(seed)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGET_MODULES, init_lora_weights=False)
        get_peft_model(base, config).save_pretrained(out)
        config_file = out / "adapter_config.json"
        saved = json.loads(config_file.read_text())
        saved["base_model_name_or_path"] = self.base  # what the platform's training writes
        config_file.write_text(json.dumps(saved))


@pytest.fixture(scope="session")
def make_adapter(tmp_path_factory) -> AdapterMaker:
    return AdapterMaker(tmp_path_factory.mktemp("adapters"))


def adapter_store():
    from django.conf import settings

    from core.adapter_store import adapter_store as store_for

    return store_for(settings.CONFIG.dynamic_lora_path, settings.CONFIG.s3)


def register_fine_tuned_model(persona: Persona, suffix: str, base: str = BASE) -> str:
    """The rows a succeeded fine-tuning job leaves: job, its training file, the fine-tuned model."""
    from finetuning.models import File, FineTunedModel, FineTuningJob, JobStatus, ModelRevision

    name = f"{base}:{suffix}"
    organization = persona.organization
    training_file = File.objects.create(
        organization=organization, filename="train.jsonl", bytes=1, storage_key=f"test/{suffix}",
        example_count=10, token_count=100, max_example_tokens=10,
    )
    job = FineTuningJob.objects.create(
        organization=organization, model=base, training_file=training_file.id, suffix=suffix, seed=0,
        hyperparameters={"n_epochs": 1, "batch_size": 1, "learning_rate_multiplier": 1.0},
        status=JobStatus.SUCCEEDED, fine_tuned_model=name,
    )
    model = FineTunedModel.objects.create(name=name, organization=organization, job=job, base_model=base, suffix=suffix)
    ModelRevision.objects.create(model=model, number=1, job=job)
    return name


def publish_fine_tuned_model(persona: Persona, suffix: str, folder: Path, base: str = BASE) -> str:
    """What the platform does when a job succeeds: the adapter to the dynamic path, then the row."""
    name = f"{base}:{suffix}"
    adapter_store().publish(name, folder, 1)  # a new model's first revision, whatever an earlier run left
    return register_fine_tuned_model(persona, suffix, base)
