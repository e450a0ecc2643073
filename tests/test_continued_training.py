"""Continued fine-tuning: a job whose model is one of the organization's fine-tuned models trains on
from that adapter, keeps its shape, and the new model's lineage names where it came from."""

import json
from pathlib import Path

import pytest
from django.conf import settings

from finetuning.job_creation import resolve_hyperparameters
from finetuning.models import FineTunedModel, FineTuningJob, JobStatus
from tests.personas import good_dataset
from tests.test_files_api import error_of, upload
from workers.run_job import run_job

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


def trained(persona, suffix: str, parent: str | None = None, **lora) -> FineTunedModel:
    """A model as a succeeded job leaves it (no adapter published: these tests never train it)."""
    hyperparameters = resolve_hyperparameters(lora, 12, settings.MODEL_CATALOG.get(BASE))
    job = FineTuningJob.objects.create(
        organization=persona.organization, model=BASE, parent_model=parent, training_file="file-gone", suffix=suffix,
        seed=0, hyperparameters=hyperparameters, status=JobStatus.SUCCEEDED, fine_tuned_model=f"{BASE}:{suffix}",
    )  # fmt: skip
    return FineTunedModel.objects.create(
        name=f"{BASE}:{suffix}", organization=persona.organization, job=job, base_model=BASE, suffix=suffix
    )


def create(persona, **body):
    return persona.api.post("/v1/fine_tuning/jobs", body, format="json")


def lineage_of(persona, name: str) -> dict:
    response = persona.api.get("/v1/models")
    assert response.status_code == 200, response.json()
    models = response.json()["data"]
    return next(m["lineage"] for m in models if m["id"] == name)


def losses(job_id: str) -> list[float]:
    events = FineTuningJob.objects.get(pk=job_id).events.filter(type="metrics")
    return [e.data["train_loss"] for e in sorted(events, key=lambda e: e.data["step"])]


@pytest.mark.django_db
def test_it_keeps_the_parents_adapter_shape_and_shows_the_model_as_sent(alice, django_capture_on_commit_callbacks):
    trained(alice, "parent", lora_r=4, lora_alpha=12, target_modules=["v_proj", "down_proj"])
    file_id = upload(alice, good_dataset(12)).json()["id"]
    with django_capture_on_commit_callbacks() as callbacks:
        # The same values as the parent's (in another order) are no conflict; the rest is the parent's.
        response = create(alice, model=f"{BASE}:parent", training_file=file_id, suffix="child",
                          hyperparameters={"lora_r": 4, "target_modules": ["down_proj", "v_proj"]})  # fmt: skip
    job = response.json()
    assert response.status_code == 200, job
    assert job["model"] == f"{BASE}:parent" and job["suffix"] == "child" and len(callbacks) == 1
    hp = job["hyperparameters"]
    assert (hp["lora_r"], hp["lora_alpha"], hp["target_modules"]) == (4, 12, ["v_proj", "down_proj"])
    stored = FineTuningJob.objects.get(pk=job["id"])
    assert (stored.model, stored.parent_model) == (BASE, f"{BASE}:parent")  # the unique (model, suffix) still holds


@pytest.mark.django_db
@pytest.mark.parametrize(("asked", "param"), [
    ({"lora_r": 16}, "hyperparameters.lora_r"),
    ({"lora_alpha": 8}, "hyperparameters.lora_alpha"),
    ({"target_modules": ["q_proj"]}, "hyperparameters.target_modules"),
])  # fmt: skip
def test_a_hyperparameter_that_conflicts_with_the_parent_is_a_400_and_nothing_is_queued(
    alice, asked, param, django_capture_on_commit_callbacks
):
    trained(alice, "parent")  # rank 8, alpha 16, every projection
    file_id = upload(alice, good_dataset(12)).json()["id"]
    with django_capture_on_commit_callbacks() as callbacks:
        response = create(alice, model=f"{BASE}:parent", training_file=file_id, hyperparameters=asked)
    assert response.status_code == 400, response.json()
    error = error_of(response)
    assert error["param"] == param and error["code"] == "conflicts_with_parent_model"
    assert f"{BASE}:parent" in error["message"]
    assert FineTuningJob.objects.count() == 1 and callbacks == []  # only the parent's job


@pytest.mark.django_db
def test_another_organizations_model_is_not_found(alice, charlie):
    trained(alice, "alices")
    file_id = upload(charlie, good_dataset(12)).json()["id"]
    for model in (f"{BASE}:alices", f"{BASE}:nobodys"):
        response = create(charlie, model=model, training_file=file_id)
        assert response.status_code == 404, response.json()
        assert error_of(response)["param"] == "model" and error_of(response)["code"] == "model_not_found"
    assert not FineTuningJob.objects.filter(organization=charlie.organization).exists()


@pytest.mark.django_db
def test_an_uploaded_adapter_cannot_be_continued(alice):
    uploaded = f"{BASE}:uploaded"
    FineTunedModel.objects.create(name=uploaded, organization=alice.organization, base_model=BASE, suffix="uploaded")
    file_id = upload(alice, good_dataset(12)).json()["id"]
    response = create(alice, model=uploaded, training_file=file_id)
    assert response.status_code == 400 and error_of(response)["code"] == "model_not_continuable"


@pytest.mark.django_db(transaction=True)  # /v1/models authenticates on another thread's connection
def test_lineage_shows_the_parent_and_the_chain_up_to_a_deleted_model(alice):
    trained(alice, "a")
    trained(alice, "b", parent=f"{BASE}:a")
    trained(alice, "c", parent=f"{BASE}:b")
    trained(alice, "d", parent=f"{BASE}:c")
    a_job = FineTuningJob.objects.get(suffix="a").pk
    assert lineage_of(alice, f"{BASE}:a") == {"origin": "trained", "job": a_job}
    lineage = lineage_of(alice, f"{BASE}:d")
    assert lineage["parent"] == f"{BASE}:c"
    assert lineage["ancestors"] == [f"{BASE}:c", f"{BASE}:b", f"{BASE}:a"]

    assert alice.api.delete(f"/v1/models/{BASE}:b").status_code == 200
    # b is still d's grandparent, but what b came from is no longer known.
    assert lineage_of(alice, f"{BASE}:d")["ancestors"] == [f"{BASE}:c", f"{BASE}:b"]


@pytest.mark.django_db(transaction=True)
def test_a_job_whose_parent_was_deleted_before_it_trained_fails_with_that_reason(alice, not_queued):
    trained(alice, "parent")
    file_id = upload(alice, good_dataset(12)).json()["id"]
    job_id = create(alice, model=f"{BASE}:parent", training_file=file_id, suffix="orphan").json()["id"]
    assert alice.api.delete(f"/v1/models/{BASE}:parent").status_code == 200

    assert run_job(job_id, worker="in-test") == "failed"
    job = alice.api.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    assert job["error"]["code"] == "parent_model_deleted" and f"{BASE}:parent, was deleted" in job["error"]["message"]
    assert not FineTunedModel.objects.filter(name=f"{BASE}:orphan").exists()


@pytest.mark.training
@pytest.mark.django_db(transaction=True)
def test_a_continued_job_starts_from_its_parents_loss_not_the_base_models(alice, not_queued):
    file_id = upload(alice, good_dataset(12)).json()["id"]
    whole_dataset = {"batch_size": 12}  # every step sees every example: step losses compare across jobs
    # The parent is a fresh job: its first step's loss is the base model's (LoRA starts as a no-op).
    parent = create(alice, model=BASE, training_file=file_id, suffix="parent",
                    hyperparameters=whole_dataset | {"n_epochs": 6, "learning_rate_multiplier": 5})  # fmt: skip
    assert run_job(parent.json()["id"], worker="in-test") == "succeeded"
    child = create(alice, model=f"{BASE}:parent", training_file=file_id, suffix="child",
                   hyperparameters=whole_dataset | {"n_epochs": 1})  # fmt: skip
    assert child.status_code == 200, child.json()
    assert run_job(child.json()["id"], worker="in-test") == "succeeded"

    parent_losses, child_losses = losses(parent.json()["id"]), losses(child.json()["id"])
    fresh_first, parent_last, child_first = parent_losses[0], parent_losses[-1], child_losses[0]
    print(f"fresh first {fresh_first:.4f}, parent last {parent_last:.4f}, continued first {child_first:.4f}")
    assert parent_last < 0.6 * fresh_first  # the parent learnt something worth keeping
    assert child_first < 0.6 * fresh_first
    # At most the parent's last step's loss (one more update went into the parent after it), and near it.
    assert child_first <= parent_last * 1.1 and child_first > parent_last * 0.3

    job = alice.api.get(f"/v1/fine_tuning/jobs/{child.json()['id']}").json()
    assert (job["model"], job["fine_tuned_model"]) == (f"{BASE}:parent", f"{BASE}:child")
    config = json.loads((Path(settings.CONFIG.dynamic_lora_path) / f"{BASE}:child" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == BASE and config["r"] == 8
    lineage = lineage_of(alice, f"{BASE}:child")
    assert lineage["parent"] == f"{BASE}:parent" and lineage["ancestors"] == [f"{BASE}:parent"]
