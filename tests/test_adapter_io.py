"""Adapters in and out: downloads (a model's, a checkpoint's) that PEFT loads, uploads of adapters
trained elsewhere (checked before anything is written), and a succeeded job's metrics as CSV."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import tarfile
import zipfile
from pathlib import Path

import pytest
from django.conf import settings

from core.adapter_store import CONFIG_FILE, WEIGHTS_FILE
from finetuning.models import File, FineTunedModel
from tests.adapter_archives import (
    _checkpoint_of,
    _wrong_shapes,
    adapter_files,
    body_of,
    send,
    tar_gz,
    tensors,
    unpacked,
)
from tests.file_uploads import upload
from tests.inference_fixtures import BASE, adapter_store, make_adapter  # noqa: F401
from tests.inference_fixtures import publish_fine_tuned_model as published
from tests.personas import good_dataset
from workers.run_job import run_job

pytestmark = pytest.mark.django_db(transaction=True)


def adapter_url(name: str) -> str:
    return f"/v1/fine_tuning/models/{name}/adapter"


def with_config(folder: Path, **changes) -> dict[str, bytes]:
    files = adapter_files(folder)
    files[CONFIG_FILE] = json.dumps(json.loads(files[CONFIG_FILE]) | changes).encode()
    return files


@pytest.fixture
def adapter(make_adapter) -> Path:  # noqa: F811
    return make_adapter(seed=7)


@pytest.fixture(autouse=True)
def _fresh_store():
    """The dynamic path outlives the test database: no adapter of an earlier run under our names."""
    names = ["download", "private", "checkpointed", "original", "copy", "zipped", "refused", "large", "bomb", "over-quota", "deleted"]
    for suffix in names:
        adapter_store().delete(f"{BASE}:{suffix}")
    yield


def test_it_downloads_a_models_adapter_that_peft_loads_with_the_weights_it_serves(alice, adapter, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    name = published(alice, "download", adapter)
    response = alice.api.get(adapter_url(name))
    assert response.status_code == 200 and response["Content-Type"] == "application/gzip"
    assert "SmolLM2-135M-Instruct--download.tar.gz" in response["Content-Disposition"]
    folder = unpacked(body_of(response), tmp_path / "downloaded")
    assert json.loads((folder / CONFIG_FILE).read_text())["base_model_name_or_path"] == BASE

    weights = Path(settings.DATA_DIR) / "models" / BASE
    prompt = torch.tensor([[1, 504, 3458, 282, 4649, 314]])

    def logits(adapter_folder: Path) -> torch.Tensor:
        base = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
        with torch.no_grad():
            return PeftModel.from_pretrained(base, adapter_folder).eval()(prompt).logits

    stored = adapter_store().fetch(name, tmp_path / "cache")
    assert torch.equal(logits(folder), logits(stored))


def test_another_organizations_model_and_checkpoint_are_404(alice, charlie, adapter):
    name = published(alice, "private", adapter)
    checkpoint = _checkpoint_of(alice, name, adapter)
    assert charlie.api.get(adapter_url(name)).json()["error"]["code"] == "model_not_found"
    assert charlie.api.get(adapter_url(name)).status_code == 404
    url = f"/v1/fine_tuning/jobs/{checkpoint.job_id}/checkpoints/{checkpoint.id}/adapter"
    assert charlie.api.get(url).status_code == 404
    assert alice.api.get(adapter_url(f"{BASE}:nothing-here")).status_code == 404


def test_it_downloads_a_checkpoints_adapter(alice, adapter, tmp_path):
    name = published(alice, "checkpointed", adapter)
    checkpoint = _checkpoint_of(alice, name, adapter)
    response = alice.api.get(f"/v1/fine_tuning/jobs/{checkpoint.job_id}/checkpoints/{checkpoint.id}/adapter")
    assert response.status_code == 200
    folder = unpacked(body_of(response), tmp_path / "checkpoint")
    assert adapter_files(folder) == adapter_files(adapter)
    missing = alice.api.get(f"/v1/fine_tuning/jobs/{checkpoint.job_id}/checkpoints/ftckpt-nope/adapter")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "checkpoint_not_found"


def test_a_downloaded_adapter_uploaded_under_another_suffix_is_listed_and_stored_with_identical_tensors(alice, adapter, tmp_path):
    name = published(alice, "original", adapter)
    archive = body_of(alice.api.get(adapter_url(name)))
    response = send(alice, archive, "copy")
    assert response.status_code == 200, response.json()
    copy = f"{BASE}:copy"
    assert response.json() == response.json() | {"id": copy, "object": "model", "owned_by": alice.organization.slug, "parent": BASE}
    row = FineTunedModel.objects.get(name=copy)
    assert row.job is None and row.organization == alice.organization and row.uploaded_bytes > 0
    assert copy in [model["id"] for model in alice.api.get("/v1/models").json()["data"]]
    stored = adapter_store().fetch(copy, tmp_path / "cache")
    original, uploaded = tensors(adapter / WEIGHTS_FILE), tensors(stored / WEIGHTS_FILE)
    assert original.keys() == uploaded.keys() and all((original[k] == uploaded[k]).all() for k in original)
    assert json.loads((stored / CONFIG_FILE).read_text())["base_model_name_or_path"] == BASE
    # Its own adapter downloads too, and the suffix is now taken (for uploads and jobs alike).
    assert alice.api.get(adapter_url(copy)).status_code == 200
    again = send(alice, archive, "copy")
    assert again.status_code == 409 and again.json()["error"]["code"] == "suffix_taken"
    training_file = upload(alice, good_dataset(12)).json()["id"]
    job = alice.api.post("/v1/fine_tuning/jobs", {"model": BASE, "training_file": training_file, "suffix": "copy"}, format="json")
    assert job.status_code == 409 and job.json()["error"]["code"] == "suffix_taken"


def test_a_zip_of_the_peft_folder_with_its_readme_is_accepted(alice, adapter):
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for file, data in adapter_files(adapter).items():
            archive.writestr(file, data)
        archive.writestr("README.md", "a model card")
    response = send(alice, out.getvalue(), "zipped", name="adapter.zip")
    assert response.status_code == 200, response.json()
    assert adapter_store().version(f"{BASE}:zipped") is not None


REFUSALS = {
    "not LoRA": (lambda f: tar_gz(with_config(f, peft_type="IA3")), "only LoRA adapters"),
    "pickle weights": (lambda f: tar_gz(adapter_files(f) | {"adapter_model.bin": b"\x80\x04K."}), "is a pickle"),
    "only pickle weights": (
        lambda f: tar_gz({CONFIG_FILE: adapter_files(f)[CONFIG_FILE], "adapter_model.bin": b"\x80\x04K."}), "is a pickle"
    ),
    "wrong shapes": (lambda f: tar_gz(_wrong_shapes(f)), "has shape [8, 100]"),
    "rank too large": (lambda f: tar_gz(with_config(f, r=32)), "larger than HuggingFaceTB/SmolLM2-135M-Instruct's max_lora_rank of 16"),
    "unknown module": (lambda f: tar_gz(with_config(f, target_modules=["lm_head"])), "are not linear layers"),
    "DoRA": (lambda f: tar_gz(with_config(f, use_dora=True)), "DoRA"),
    "parent member": (lambda f: tar_gz(adapter_files(f) | {"../evil.json": b"{}"}), "outside the archive root"),
    "absolute member": (lambda f: tar_gz(adapter_files(f) | {"/etc/evil.json": b"{}"}), "absolute path"),
    "symlink": (lambda f: tar_gz({CONFIG_FILE: adapter_files(f)[CONFIG_FILE]}, {WEIGHTS_FILE: (tarfile.SYMTYPE, "/etc/passwd")}), "symbolic link"),
    "hard link": (lambda f: tar_gz({CONFIG_FILE: adapter_files(f)[CONFIG_FILE]}, {WEIGHTS_FILE: (tarfile.LNKTYPE, CONFIG_FILE)}), "hard link"),
    "nested folder": (lambda f: tar_gz({f"adapter/{k}": v for k, v in adapter_files(f).items()}), "not at the archive root"),
    "missing weights": (lambda f: tar_gz({CONFIG_FILE: adapter_files(f)[CONFIG_FILE]}), f"no {WEIGHTS_FILE}"),
    "not an archive": (lambda f: b"just some bytes", "not a readable .tar.gz or .zip"),
    "broken config": (lambda f: tar_gz(adapter_files(f) | {CONFIG_FILE: b"{not json"}), "not valid JSON"),
    "broken weights": (lambda f: tar_gz(adapter_files(f) | {WEIGHTS_FILE: b"\x10\x00\x00\x00\x00\x00\x00\x00{}"}), "not a readable safetensors"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_it_refuses_anything_but_a_fitting_peft_lora_with_a_400_naming_it_and_writes_nothing(alice, adapter, case):
    make_archive, expected = REFUSALS[case]
    response = send(alice, make_archive(adapter), "refused")
    assert response.status_code == 400, response.json()
    error = response.json()["error"]
    assert error["code"] == "invalid_adapter" and expected in error["message"], error
    _nothing_written("refused")


def _nothing_written(suffix: str) -> None:
    assert not FineTunedModel.objects.filter(suffix=suffix).exists()
    assert adapter_store().version(f"{BASE}:{suffix}") is None


def test_a_too_large_archive_and_an_archive_bomb_are_refused(alice, adapter, settings):
    archive = tar_gz(adapter_files(adapter))
    settings.CONFIG = dataclasses.replace(settings.CONFIG, max_adapter_upload_bytes=len(archive) - 1)
    too_large = send(alice, archive, "large")
    assert too_large.status_code == 400 and too_large.json()["error"]["code"] == "adapter_too_large"
    assert "MAX_ADAPTER_UPLOAD_MB" in too_large.json()["error"]["message"]
    # Small packed, large unpacked: zeros compress a thousandfold.
    bomb = tar_gz(adapter_files(adapter) | {"README.md": bytes(64 * 1024 * 1024)})
    settings.CONFIG = dataclasses.replace(settings.CONFIG, max_adapter_upload_bytes=len(bomb) + 1024 * 1024)
    exploded = send(alice, bomb, "bomb")
    assert exploded.status_code == 400 and exploded.json()["error"]["code"] == "adapter_too_large"
    _nothing_written("large")
    _nothing_written("bomb")


def test_an_upload_counts_against_the_storage_quota(alice, adapter, settings):
    limits = dataclasses.replace(settings.CONFIG.limits, storage_bytes_per_organization=1024)
    settings.CONFIG = dataclasses.replace(settings.CONFIG, limits=limits)
    response = send(alice, tar_gz(adapter_files(adapter)), "over-quota")
    assert response.status_code == 403 and response.json()["error"]["code"] == "storage_quota_exceeded"
    _nothing_written("over-quota")


def test_an_upload_for_a_model_outside_the_catalog_is_refused(alice, adapter):
    response = send(alice, tar_gz(adapter_files(adapter)), "elsewhere", model="meta-llama/Llama-3-8B")
    assert response.status_code == 400 and response.json()["error"]["code"] == "model_not_available"


def test_deleting_an_uploaded_model_removes_its_adapter(alice, adapter):
    assert send(alice, tar_gz(adapter_files(adapter)), "deleted").status_code == 200
    from finetuning.registry import delete_fine_tuned_model

    delete_fine_tuned_model(FineTunedModel.objects.get(suffix="deleted"))
    _nothing_written("deleted")


@pytest.mark.training
def test_a_succeeded_job_has_its_metrics_as_a_csv_result_file(alice, monkeypatch, tmp_path):
    from tests.fine_tuning_jobs import launch

    monkeypatch.setattr("finetuning.training_turns.send_to_trainer", lambda job_id: None)  # trained here, not by a worker
    job_id = launch(alice, {"n_epochs": 2, "batch_size": 6}, "results")  # 12 examples: 4 steps
    assert run_job(job_id, worker="in-test") == "succeeded"
    job = alice.api.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    [file_id] = job["result_files"]
    assert alice.api.get(f"/v1/files/{file_id}").json()["purpose"] == "fine-tune-results"
    content = alice.api.get(f"/v1/files/{file_id}/content")
    assert content["Content-Type"] == "text/csv"
    rows = list(csv.DictReader(io.StringIO(body_of(content).decode())))
    assert [int(row["step"]) for row in rows] == [1, 2, 3, 4]
    assert all(float(row["train_loss"]) > 0 and int(row["trained_tokens"]) > 0 for row in rows)
    assert File.objects.get(pk=file_id).organization == alice.organization
    # The trained adapter and its checkpoints download as PEFT folders.
    model = alice.api.get(adapter_url(job["fine_tuned_model"]))
    assert json.loads((unpacked(body_of(model), tmp_path / "model") / CONFIG_FILE).read_text())["r"] == 8
    checkpoint = alice.api.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"][0]["id"]
    download = alice.api.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints/{checkpoint}/adapter")
    assert (unpacked(body_of(download), tmp_path / "checkpoint") / WEIGHTS_FILE).stat().st_size > 0
