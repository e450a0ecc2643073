"""Adapter archives for tests: built from a PEFT folder or from a tiny adapter made with NumPy, sent
through the API's door (``POST /v1/fine_tuning/adapters``) or the dashboard's upload form, and
downloads read back."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
from django.urls import reverse
from safetensors import safe_open
from safetensors.numpy import save, save_file

from core.adapter_store import CONFIG_FILE, WEIGHTS_FILE
from finetuning import storage
from finetuning.models import Checkpoint, FineTuningJob
from tests.inference_fixtures import BASE

ADAPTERS = "/v1/fine_tuning/adapters"


def body_of(response) -> bytes:
    return b"".join(response.streaming_content)


def unpacked(archive: bytes, into: Path) -> Path:
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        assert sorted(tar.getnames()) == [CONFIG_FILE, WEIGHTS_FILE]
        tar.extractall(into, filter="data")
    return into


def tensors(path: Path) -> dict:
    with safe_open(str(path), framework="numpy") as weights:
        return {name: weights.get_tensor(name) for name in weights.keys()}


def tar_gz(members: dict[str, bytes], links: dict[str, tuple[bytes, str]] | None = None) -> bytes:
    """An archive of ``members`` (name: bytes); ``links``: name -> (tar type, target)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, (kind, target) in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, target
            tar.addfile(info)
    return out.getvalue()


def adapter_files(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in (CONFIG_FILE, WEIGHTS_FILE)}


def send(persona, archive: bytes, suffix: str, name: str = "adapter.tar.gz", model: str = BASE):
    handle = io.BytesIO(archive)
    handle.name = name
    return persona.api.post(ADAPTERS, {"file": handle, "model": model, "suffix": suffix}, format="multipart")


def _checkpoint_of(persona, name: str, folder: Path) -> Checkpoint:
    job = FineTuningJob.objects.get(fine_tuned_model=name)
    key = f"{storage.checkpoints_prefix(job.pk)}attempt-1/step-3"
    for file, data in adapter_files(folder).items():
        storage.files().put(f"{key}/{file}", data)
    return Checkpoint.objects.create(job=job, step_number=3, epoch=1, metrics={}, storage_key=key)


def _wrong_shapes(folder: Path) -> dict[str, bytes]:
    weights = tensors(folder / WEIGHTS_FILE)
    first = sorted(weights)[0]  # layers.0.mlp.down_proj.lora_A: [8, 1536]
    weights[first] = weights[first][:, :100].copy()
    out = folder.parent / f"{folder.name}-wrong.safetensors"
    save_file(weights, str(out))
    return adapter_files(folder) | {WEIGHTS_FILE: out.read_bytes()}


def upload_form(client, archive: bytes, suffix: str, model: str = BASE, name: str = "adapter.tar.gz"):
    handle = io.BytesIO(archive)
    handle.name = name
    fields = {"adapter-file": handle, "adapter-model": model, "adapter-suffix": suffix}
    return client.post(reverse("dashboard:adapter_upload"), fields)


def field_of(page: str, name: str) -> str:
    """The form field's block (label, input, errors) on the page."""
    start = page.index(f'id="field-{name}"')
    return page[start : page.index("</div>", start)]


def _archive(folder) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            tar.add(folder / name, arcname=name)
    return out.getvalue()


# --- a tiny valid adapter (rank 1, q_proj of one layer), built with NumPy ----------------------

HIDDEN, Q_OUT = 576, 576  # SmolLM2-135M: q_proj is 576 -> 576
A_NAME = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B_NAME = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def config(**changes) -> bytes:
    base = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": BASE, "r": 1, "lora_alpha": 2,
        "lora_dropout": 0.0, "target_modules": ["q_proj"], "bias": "none", "use_rslora": False, "use_dora": False,
    }
    return json.dumps(base | changes).encode()


def weights(a: np.ndarray | None = None, b: np.ndarray | None = None) -> bytes:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((1, HIDDEN)).astype(np.float32) if a is None else a
    b = rng.standard_normal((Q_OUT, 1)).astype(np.float32) if b is None else b
    return save({A_NAME: a, B_NAME: b})


def files(**replaced: bytes) -> dict[str, bytes]:
    return {CONFIG_FILE: replaced.get("config", config()), WEIGHTS_FILE: replaced.get("weights", weights())}
