"""Continued fine-tuning: a job whose model is an adapter of the organization's (a fine-tuned model,
a revision of one, a checkpoint, an uploaded or composed model) trains on from exactly that adapter,
keeps its shape, and the job and the new model's lineage name the exact parent."""

import json
from pathlib import Path

import pytest
from django.conf import settings

from finetuning import publishing
from finetuning.job_creation import resolve_hyperparameters
from finetuning.models import Checkpoint, FineTunedModel, FineTuningJob, JobStatus, ModelRevision
from tests.adapter_archives import send
from tests.file_uploads import error_of, upload
from tests.fine_tuning_jobs import trained
from tests.personas import good_dataset
from workers.run_job import run_job

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
# An adapter trained elsewhere, as PEFT writes its config (the weights are never read by these tests).
UPLOADED_CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


def checkpoint(model: FineTunedModel, step: int) -> str:
    """A checkpoint of the job that trained ``model``'s first revision; its name."""
    assert model.job is not None
    saved = Checkpoint.objects.create(job=model.job, step_number=step, epoch=1, metrics={}, storage_key="gone")
    return saved.name


def published_elsewhere(persona, suffix: str, tmp_path: Path, composed: bool = False, **config) -> str:
    """An uploaded (or composed) model: no job trained it; its adapter_config.json is in the dynamic
    LoRA path, with ``config`` over UPLOADED_CONFIG."""
    name = f"{BASE}:{suffix}"
    folder = tmp_path / suffix
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(UPLOADED_CONFIG | config))
    (folder / "adapter_model.safetensors").write_bytes(b"never read")
    publishing.store_for(BASE).publish(name, folder, 1)
    lineage = {"parents": [], "method": "linear"} if composed else None
    model = FineTunedModel.objects.create(
        name=name, organization=persona.organization, base_model=BASE, suffix=suffix, composition=lineage
    )
    ModelRevision.objects.create(model=model, number=1)
    return name


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
                          hyperparameters={"lora_r": 4, "target_modules": ["down_proj", "v_proj"]})
    job = response.json()
    assert response.status_code == 200, job
    assert job["model"] == f"{BASE}:parent" and job["suffix"] == "child" and len(callbacks) == 1
    # The exact parent: the revision the name answered with when the job was created.
    assert job["parent_model"] == f"{BASE}:parent@r1"
    hp = job["hyperparameters"]
    assert (hp["lora_r"], hp["lora_alpha"], hp["target_modules"]) == (4, 12, ["v_proj", "down_proj"])
    stored = FineTuningJob.objects.get(pk=job["id"])
    assert (stored.model, stored.parent_model) == (BASE, f"{BASE}:parent")  # the unique (model, suffix) still holds


@pytest.mark.django_db
@pytest.mark.parametrize(("asked", "param"), [
    ({"lora_r": 16}, "hyperparameters.lora_r"),
    ({"lora_alpha": 8}, "hyperparameters.lora_alpha"),
    ({"target_modules": ["q_proj"]}, "hyperparameters.target_modules"),
])
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
def test_another_organizations_model_revision_or_checkpoint_is_not_found(alice, charlie):
    alices = trained(alice, "alices")
    file_id = upload(charlie, good_dataset(12)).json()["id"]
    for model in (f"{BASE}:alices", f"{BASE}:alices@r1", checkpoint(alices, 3), f"{BASE}:nobodys", f"{BASE}:nobodys@r1"):
        response = create(charlie, model=model, training_file=file_id)
        assert response.status_code == 404, response.json()
        assert error_of(response)["param"] == "model" and error_of(response)["code"] == "model_not_found"
    assert not FineTuningJob.objects.filter(organization=charlie.organization).exists()


@pytest.mark.django_db
def test_an_unknown_revision_or_checkpoint_of_an_own_model_is_not_found_and_nothing_is_queued(
    alice, django_capture_on_commit_callbacks
):
    parent = trained(alice, "parent")
    checkpoint(parent, 3)
    file_id = upload(alice, good_dataset(12)).json()["id"]
    with django_capture_on_commit_callbacks() as callbacks:
        for model in (f"{BASE}:parent@r2", f"{BASE}:parent:ckpt-step-4", f"{BASE}:parent@r2:ckpt-step-3"):
            response = create(alice, model=model, training_file=file_id)
            assert response.status_code == 404, response.json()
            error = error_of(response)
            assert (error["param"], error["code"]) == ("model", "model_not_found") and model in error["message"]
    assert FineTuningJob.objects.count() == 1 and callbacks == []  # only the parent's job


@pytest.mark.django_db
@pytest.mark.parametrize("shape", [
    "{parent}@r" + "9" * 5000, "{parent}@r0", "{parent}@r-1", "{parent}:ckpt-step-" + "9" * 5000, "{parent}:ckpt-step--1",
    "{parent}@r1:ckpt-step-1:ckpt-step-1", "{parent}\x00@r1", "{parent}@r1\x00", "{parent}:" + "x" * 100_000,
], ids=["revision of 5,000 digits", "r0", "r-1", "step of 5,000 digits", "step -1", "two steps", "NUL", "NUL after", "a long rest"])
def test_a_malformed_revision_or_checkpoint_name_is_refused_naming_model_and_nothing_is_queued(alice, shape):
    trained(alice, "parent")
    file_id = upload(alice, good_dataset(12)).json()["id"]
    response = create(alice, model=shape.format(parent=f"{BASE}:parent"), training_file=file_id)
    assert 400 <= response.status_code < 500, response.json()
    assert error_of(response)["param"] == "model"
    assert FineTuningJob.objects.count() == 1  # only the parent's job


@pytest.mark.django_db
def test_a_pinned_revision_is_continued_exactly_and_a_bare_name_pins_the_one_it_answers_with(alice, client):
    support = trained(alice, "support", lora_r=4)
    second = FineTuningJob.objects.create(
        organization=alice.organization, model=BASE, parent_model=f"{BASE}:support@r1", training_file="file-gone",
        suffix="support", revision=2, seed=0, hyperparameters=support.job.hyperparameters, status=JobStatus.SUCCEEDED,
    )
    ModelRevision.objects.create(model=support, number=2, job=second)
    FineTunedModel.objects.filter(pk=support.pk).update(revision=2)
    file_id = upload(alice, good_dataset(12)).json()["id"]

    def parent_of(model: str, suffix: str) -> str:
        response = create(alice, model=model, training_file=file_id, suffix=suffix)
        assert response.status_code == 200, response.json()
        assert response.json()["model"] == model  # as sent
        return response.json()["parent_model"]

    assert parent_of(f"{BASE}:support@r1", "from-r1") == f"{BASE}:support@r1"
    assert parent_of(f"{BASE}:support", "from-current") == f"{BASE}:support@r2"
    FineTunedModel.objects.filter(pk=support.pk).update(revision=1)  # rolled back: the name answers with r1
    assert parent_of(f"{BASE}:support", "after-rollback") == f"{BASE}:support@r1"

    client.force_login(alice.user)
    job = FineTuningJob.objects.get(suffix="from-current")
    assert f"from <code>{BASE}:support@r2</code>" in client.get(f"/jobs/{job.pk}").content.decode()


@pytest.mark.django_db
def test_a_checkpoint_is_continued_with_its_jobs_adapter_shape_published_or_not(alice):
    parent = trained(alice, "parent", lora_r=4, lora_alpha=12, target_modules=["q_proj"])
    # A checkpoint of a job that published nothing (it failed after saving it) is an adapter all the same.
    unpublished = FineTuningJob.objects.create(
        organization=alice.organization, model=BASE, training_file="file-gone", suffix="failed", seed=0,
        hyperparameters=resolve_hyperparameters({"lora_r": 2}, 12, settings.MODEL_CATALOG.get(BASE)), status=JobStatus.FAILED,
    )
    failed_checkpoint = Checkpoint.objects.create(job=unpublished, step_number=5, epoch=1, metrics={}, storage_key="gone").name
    file_id = upload(alice, good_dataset(12)).json()["id"]
    for name, (rank, alpha, targets) in [(checkpoint(parent, 3), (4, 12, ["q_proj"])), (failed_checkpoint, (2, 4, None))]:
        response = create(alice, model=name, training_file=file_id)
        job = response.json()
        assert response.status_code == 200, job
        assert job["model"] == job["parent_model"] == name
        hp = job["hyperparameters"]
        assert (hp["lora_r"], hp["lora_alpha"]) == (rank, alpha) and hp["target_modules"] == (targets or hp["target_modules"])
    conflict = create(alice, model=f"{BASE}:parent:ckpt-step-3", training_file=file_id, hyperparameters={"lora_r": 8})
    assert conflict.status_code == 400 and error_of(conflict)["param"] == "hyperparameters.lora_r"


@pytest.mark.django_db
@pytest.mark.parametrize("composed", [False, True], ids=["uploaded", "composed"])
def test_an_adapter_no_job_trained_is_continued_with_the_shape_its_config_gives(alice, composed, tmp_path):
    name = published_elsewhere(alice, "elsewhere", tmp_path, composed=composed)
    file_id = upload(alice, good_dataset(12)).json()["id"]
    response = create(alice, model=name, training_file=file_id, suffix="child")
    job = response.json()
    assert response.status_code == 200, job
    assert (job["model"], job["parent_model"]) == (name, f"{name}@r1")
    hp = job["hyperparameters"]
    assert (hp["lora_r"], hp["lora_alpha"], hp["target_modules"]) == (4, 8, ["q_proj", "v_proj"])

    conflict = create(alice, model=name, training_file=file_id, hyperparameters={"lora_alpha": 16})
    assert conflict.status_code == 400, conflict.json()
    error = error_of(conflict)
    assert (error["param"], error["code"]) == ("hyperparameters.lora_alpha", "conflicts_with_parent_model")


@pytest.mark.django_db
@pytest.mark.parametrize(("config", "problem"), [
    ({"r": "4"}, "positive whole number"),
    ({"r": 64}, "max_lora_rank of 16"),
    ({"lora_alpha": "8"}, "lora_alpha"),
    ({"lora_alpha": float("nan")}, "must be finite"),
    ({"target_modules": ["q_proj", "lm_head"]}, "['lm_head'] are not linear layers"),
    ({"target_modules": "all-linear"}, "target_modules must be a list"),
], ids=["rank a string", "rank over the catalog's", "alpha a string", "alpha NaN", "a module the base lacks", "modules not a list"])
def test_a_parent_whose_adapter_config_is_unusable_is_a_400_naming_the_problem_and_nothing_is_queued(
    alice, config, problem, tmp_path, django_capture_on_commit_callbacks
):
    name = published_elsewhere(alice, "unusable", tmp_path, **config)
    file_id = upload(alice, good_dataset(12)).json()["id"]
    with django_capture_on_commit_callbacks() as callbacks:
        response = create(alice, model=name, training_file=file_id)
    assert response.status_code == 400, response.json()
    error = error_of(response)
    assert (error["param"], error["code"]) == ("model", "model_not_continuable")
    assert problem in error["message"] and f"{name}@r1" in error["message"], error["message"]
    assert not FineTuningJob.objects.exists() and callbacks == []


@pytest.mark.django_db(transaction=True)  # /v1/models authenticates on another thread's connection
def test_lineage_shows_the_parent_and_the_chain_up_to_a_deleted_model(alice):
    trained(alice, "a")
    trained(alice, "b", parent=f"{BASE}:a")  # jobs of old recorded a bare name: taken for its first revision
    trained(alice, "c", parent=f"{BASE}:b@r1")
    trained(alice, "d", parent=f"{BASE}:c@r1")
    a_job = FineTuningJob.objects.get(suffix="a").pk
    assert lineage_of(alice, f"{BASE}:a") == {"origin": "trained", "job": a_job}
    lineage = lineage_of(alice, f"{BASE}:d")
    assert lineage["parent"] == f"{BASE}:c@r1"
    assert lineage["ancestors"] == [f"{BASE}:c@r1", f"{BASE}:b@r1", f"{BASE}:a"]

    assert alice.api.delete(f"/v1/models/{BASE}:b").status_code == 200
    # b is still d's grandparent, but what b came from is no longer known.
    assert lineage_of(alice, f"{BASE}:d")["ancestors"] == [f"{BASE}:c@r1", f"{BASE}:b@r1"]


@pytest.mark.django_db(transaction=True)
def test_lineage_names_a_checkpoint_parent_and_goes_on_through_the_job_that_saved_it(alice):
    a = trained(alice, "a")
    trained(alice, "b", parent=checkpoint(a, 2))
    trained(alice, "c", parent=f"{BASE}:b@r1")
    lineage = lineage_of(alice, f"{BASE}:c")
    assert lineage["parent"] == f"{BASE}:b@r1"
    assert lineage["ancestors"] == [f"{BASE}:b@r1", f"{BASE}:a:ckpt-step-2"]
    assert FineTunedModel.objects.get(suffix="c").lineage == lineage  # one model alone reads the same chain


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("which", ["model", "checkpoint"])
def test_a_job_whose_parent_was_deleted_before_it_trained_fails_with_that_reason(alice, not_queued, which):
    parent = trained(alice, "parent")
    name = f"{BASE}:parent@r1" if which == "model" else checkpoint(parent, 1)
    file_id = upload(alice, good_dataset(12)).json()["id"]
    job_id = create(alice, model=name, training_file=file_id, suffix="orphan").json()["id"]
    assert alice.api.delete(f"/v1/models/{BASE}:parent").status_code == 200  # its checkpoints go with it

    assert run_job(job_id, worker="in-test") == "failed"
    job = alice.api.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    assert job["error"]["code"] == "parent_model_deleted" and f"{name}, was deleted" in job["error"]["message"]
    assert not FineTunedModel.objects.filter(name=f"{BASE}:orphan").exists()


@pytest.mark.training
@pytest.mark.django_db(transaction=True)
def test_a_job_continued_from_a_model_a_checkpoint_or_an_uploaded_adapter_starts_from_its_loss_not_the_base_models(
    alice, not_queued
):
    file_id = upload(alice, good_dataset(12)).json()["id"]
    whole_dataset = {"batch_size": 12}  # every step sees every example: step losses compare across jobs
    # The parent is a fresh job: its first step's loss is the base model's (LoRA starts as a no-op).
    # One step an epoch, a checkpoint at each epoch's end: ckpt-step-N holds the adapter after N updates.
    parent = create(alice, model=BASE, training_file=file_id, suffix="parent",
                    hyperparameters=whole_dataset | {"n_epochs": 6, "learning_rate_multiplier": 5})
    assert run_job(parent.json()["id"], worker="in-test") == "succeeded"
    # Its adapter, downloaded and uploaded again as a model of its own: no job here trained that one.
    archive = b"".join(alice.api.get(f"/v1/fine_tuning/models/{BASE}:parent/adapter").streaming_content)
    assert send(alice, archive, "uploaded").status_code == 200

    def first_loss(model: str, suffix: str) -> float:
        child = create(alice, model=model, training_file=file_id, suffix=suffix, hyperparameters=whole_dataset | {"n_epochs": 1})
        assert child.status_code == 200, child.json()
        assert run_job(child.json()["id"], worker="in-test") == "succeeded"
        return losses(child.json()["id"])[0]

    parent_losses = losses(parent.json()["id"])
    continued = {
        "model": first_loss(f"{BASE}:parent", "child"),
        "checkpoint": first_loss(f"{BASE}:parent:ckpt-step-3", "from-checkpoint"),
        "uploaded": first_loss(f"{BASE}:uploaded", "from-upload"),
    }
    fresh_first, after_three, parent_last = parent_losses[0], parent_losses[3], parent_losses[-1]
    print(f"parent's losses {[round(loss, 4) for loss in parent_losses]}, continued first {continued}")
    assert parent_last < 0.6 * fresh_first  # the parent learnt something worth keeping
    # From the model (and the same adapter uploaded): at most the parent's last step's loss (one more
    # update went into the parent after it), and near it.
    for start in ("model", "uploaded"):
        assert parent_last * 0.3 < continued[start] <= parent_last * 1.1, start
    assert abs(continued["uploaded"] - continued["model"]) < 0.05 * continued["model"]  # the same weights, read back
    # From the checkpoint after 3 updates: the loss the parent's 4th step measured on that adapter
    # (lora_dropout aside), well below the base model's.
    assert abs(continued["checkpoint"] - after_three) < 0.1 * after_three
    assert continued["checkpoint"] < 0.9 * fresh_first and continued["checkpoint"] > parent_last * 1.1

    job = alice.api.get(f"/v1/fine_tuning/jobs/{FineTuningJob.objects.get(suffix='child').pk}").json()
    assert (job["model"], job["parent_model"], job["fine_tuned_model"]) == (f"{BASE}:parent", f"{BASE}:parent@r1", f"{BASE}:child")
    config = json.loads((Path(settings.CONFIG.dynamic_lora_path) / f"{BASE}:child" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == BASE and config["r"] == 8
    for child, parent_name in [("child", f"{BASE}:parent@r1"), ("from-checkpoint", f"{BASE}:parent:ckpt-step-3"),
                               ("from-upload", f"{BASE}:uploaded@r1")]:
        lineage = lineage_of(alice, f"{BASE}:{child}")
        assert lineage["parent"] == parent_name and lineage["ancestors"] == [parent_name]
