"""Revisions: fine-tuning a model further under its own suffix publishes <model>@r2 beside r1; the
bare name answers with the latest, or with the revision a rollback chose; checkpoints are published
under their names as they are saved. (The engine serving them: ``test_model_revisions_served``.)"""

import uuid
from pathlib import Path

import pytest
from django.conf import settings

from core.adapter_store import adapter_store
from core.model_names import ModelName, parse_model_name, pinned_name
from finetuning.models import Checkpoint, FineTunedModel, FineTuningJob, ModelRevision
from finetuning.registry import resolve_model
from tests.file_uploads import error_of, upload
from tests.personas import good_dataset
from workers.run_job import run_job

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
NAME = f"{BASE}:assistant"
ONE_STEP = {"n_epochs": 1, "batch_size": 12}


def store():
    return adapter_store(settings.CONFIG.dynamic_lora_path, settings.CONFIG.s3)


def create(persona, model: str, suffix: str, **hyperparameters):
    file_id = upload(persona, good_dataset(12)).json()["id"]
    body = {"model": model, "training_file": file_id, "suffix": suffix, "hyperparameters": ONE_STEP | hyperparameters}
    return persona.api.post("/v1/fine_tuning/jobs", body, format="json")


def trained(persona, model: str = BASE, suffix: str = "assistant", **hyperparameters) -> str:
    response = create(persona, model, suffix, **hyperparameters)
    assert response.status_code == 200, response.json()
    assert run_job(response.json()["id"], worker="in-test") == "succeeded"
    return response.json()["id"]


@pytest.mark.parametrize(("name", "parsed"), [
    (BASE, ModelName(BASE, None)),
    (f"{BASE}:a", ModelName(BASE, "a")),
    (f"{BASE}:a@r12", ModelName(BASE, "a", 12)),
    (f"{BASE}:a:ckpt-step-3", ModelName(BASE, "a", None, 3)),
    (f"{BASE}:a@r2:ckpt-step-3", ModelName(BASE, "a", 2, 3)),
])
def test_model_names_round_trip_with_revisions_and_checkpoints(name, parsed):
    assert parse_model_name(name) == parsed and str(parsed) == name


@pytest.mark.parametrize("rest", ["a@r0", "a@r", "a@2", "a@r1@r2", "a:ckpt-step-", "a b", "a:other"])
def test_a_malformed_revision_or_checkpoint_is_an_invalid_suffix_not_another_model(rest):
    parsed = parse_model_name(f"{BASE}:{rest}")
    assert (parsed.suffix, parsed.revision, parsed.checkpoint_step) == (rest, None, None)


def test_the_pool_pins_a_bare_name_and_leaves_a_pinned_one_or_a_checkpoint_alone():
    assert pinned_name(NAME, "r3") == f"{NAME}@r3"
    assert pinned_name(f"{NAME}@r1", "r1") == f"{NAME}@r1"
    assert pinned_name(f"{NAME}:ckpt-step-2", "r1") == f"{NAME}:ckpt-step-2"


@pytest.mark.training
@pytest.mark.django_db(transaction=True)
def test_fine_tuning_a_model_under_its_own_suffix_publishes_r2_and_a_rollback_brings_r1_back(alice, not_queued):
    first_job = trained(alice)
    assert store().version(NAME).version == "r1"
    second_job = trained(alice, model=NAME, n_epochs=2)  # the same suffix: a new revision, not a 409
    model = FineTunedModel.objects.get(name=NAME)
    assert model.revision == 2 and store().version(NAME).version == "r2"
    assert store().version(f"{NAME}@r1").version == "r1"  # r1 stays, immutable, servable pinned
    job = alice.api.get(f"/v1/fine_tuning/jobs/{second_job}").json()
    assert job["fine_tuned_model"] == NAME and job["model"] == NAME

    listing = alice.api.get(f"/v1/fine_tuning/models/{NAME}/revisions").json()
    assert [(r["id"], r["current"], r["fine_tuning_job_id"]) for r in listing["data"]] == [
        (f"{NAME}@r2", True, second_job), (f"{NAME}@r1", False, first_job),
    ]
    assert all(r["final_loss"] > 0 and r["trained_tokens"] > 0 for r in listing["data"])

    rolled = alice.api.post(f"/v1/fine_tuning/models/{NAME}/rollback", {"revision": 1}, format="json")
    assert rolled.status_code == 200, rolled.json()
    assert rolled.json()["revision"] == 1 and store().version(NAME).version == "r1"
    assert resolve_model(alice.organization, NAME).revision == 1
    cards = {card["id"]: card for card in alice.api.get("/v1/models").json()["data"]}
    assert cards[NAME]["revision"] == 1
    forward = alice.api.post(f"/v1/fine_tuning/models/{NAME}/rollback", {"revision": 2}, format="json")
    assert forward.json()["revision"] == 2 and store().version(NAME).version == "r2"


@pytest.mark.django_db
def test_a_continued_job_under_its_parents_suffix_reserves_the_next_revision(alice, not_queued):
    from tests.fine_tuning_jobs import trained as registered

    registered(alice, "assistant")
    first = create(alice, NAME, "assistant")
    second = create(alice, NAME, "assistant")  # two at once: r2 and r3, never both r2
    assert first.status_code == 200 and second.status_code == 200, (first.json(), second.json())
    assert [FineTuningJob.objects.get(pk=r.json()["id"]).revision for r in (first, second)] == [2, 3]
    taken = create(alice, BASE, "assistant")  # from the base model, the suffix is still taken
    assert taken.status_code == 409 and "fine-tune it further" in error_of(taken)["message"]


@pytest.mark.django_db
def test_a_rollback_refuses_an_unknown_revision_a_bad_body_and_another_organizations_model(alice, charlie):
    model = FineTunedModel.objects.create(name=NAME, organization=alice.organization, base_model=BASE, suffix="assistant")
    ModelRevision.objects.create(model=model, number=1)
    url = f"/v1/fine_tuning/models/{NAME}/rollback"
    unknown = alice.api.post(url, {"revision": 7}, format="json")
    assert unknown.status_code == 404 and error_of(unknown)["param"] == "revision"
    assert "r7" in error_of(unknown)["message"] and "it has r1" in error_of(unknown)["message"]
    for body in ({"revision": "1"}, {"revision": 0}, {}, {"revision": 1, "also": 2}, [1]):
        response = alice.api.post(url, body, format="json")
        assert response.status_code == 400, (body, response.json())
    assert charlie.api.post(url, {"revision": 1}, format="json").status_code == 404
    assert charlie.api.get(f"/v1/fine_tuning/models/{NAME}/revisions").status_code == 404
    assert FineTunedModel.objects.get(name=NAME).revision == 1


@pytest.mark.training
@pytest.mark.django_db(transaction=True)
def test_checkpoints_are_published_as_they_are_saved_and_deleted_with_the_model(alice, not_queued):
    suffix = f"checkpointed-{uuid.uuid4().hex[:8]}"  # the dynamic path outlives each test's database
    name = f"{BASE}:{suffix}"
    trained(alice, suffix=suffix, n_epochs=2)
    names = sorted(checkpoint.name for checkpoint in Checkpoint.objects.select_related("job"))
    assert names == [f"{name}:ckpt-step-1", f"{name}:ckpt-step-2"]
    for checkpoint in names:
        assert store().version(checkpoint).version == "r1"
        usable = resolve_model(alice.organization, checkpoint)
        assert usable is not None and usable.lineage["origin"] == "checkpoint"
    job_checkpoints = alice.api.get(f"/v1/fine_tuning/jobs/{Checkpoint.objects.first().job_id}/checkpoints").json()
    assert sorted(c["fine_tuned_model_checkpoint"] for c in job_checkpoints["data"]) == names

    # A second revision's checkpoints carry its revision in their names.
    trained(alice, model=name, suffix=suffix)
    assert store().version(f"{name}@r2:ckpt-step-1") is not None

    assert alice.api.delete(f"/v1/models/{name}").status_code == 200
    dynamic = Path(settings.CONFIG.dynamic_lora_path)
    assert not [path for path in dynamic.rglob("*") if suffix in path.name]  # revisions, checkpoints: all gone
    assert resolve_model(alice.organization, names[0]) is None


@pytest.mark.django_db(transaction=True)  # the gateway reads on another thread's connection
def test_a_pinned_revision_or_checkpoint_resolves_only_for_its_organization_and_only_if_it_exists(alice, charlie):
    model = FineTunedModel.objects.create(name=NAME, organization=alice.organization, base_model=BASE, suffix="assistant")
    ModelRevision.objects.create(model=model, number=1)
    assert resolve_model(alice.organization, f"{NAME}@r1").name == f"{NAME}@r1"
    assert resolve_model(alice.organization, f"{NAME}@r2") is None
    assert resolve_model(alice.organization, f"{NAME}:ckpt-step-1") is None
    assert resolve_model(charlie.organization, f"{NAME}@r1") is None
    refused = alice.api.delete(f"/v1/models/{NAME}@r1")
    assert refused.status_code == 400 and error_of(refused)["code"] == "model_not_deletable"


@pytest.mark.training
@pytest.mark.django_db(transaction=True)
def test_a_job_that_published_nothing_keeps_its_checkpoints_for_the_retention_period_then_they_go(
    alice, not_queued, monkeypatch
):
    from datetime import timedelta

    from django.utils import timezone

    from core.adapter_store import StoreUnavailable
    from finetuning import storage
    from finetuning.registry import expire_unpublished_checkpoints

    published_suffix = f"kept-{uuid.uuid4().hex[:8]}"  # the dynamic path outlives each test's database
    trained(alice, suffix=published_suffix)
    kept = Checkpoint.objects.select_related("job").get().name

    write_revision = type(store()).write_revision

    def unreachable_for_models(self, name: str, revision: int, source_dir: Path) -> None:
        if ":ckpt-step-" not in name:  # the checkpoints land; the model's publish fails
            raise StoreUnavailable("the bucket did not answer")
        write_revision(self, name, revision, source_dir)

    monkeypatch.setattr(type(store()), "write_revision", unreachable_for_models)
    suffix = f"unpublished-{uuid.uuid4().hex[:8]}"
    job_id = create(alice, BASE, suffix, n_epochs=2).json()["id"]
    assert run_job(job_id, worker="in-test") == "failed"
    job = FineTuningJob.objects.get(pk=job_id)
    names = sorted(checkpoint.name for checkpoint in job.checkpoints.select_related("job"))
    assert job.error_code == "storage_unavailable" and names == [f"{BASE}:{suffix}:ckpt-step-{n}" for n in (1, 2)]
    assert (Path(settings.CONFIG.files_path) / storage.checkpoints_prefix(job_id)).is_dir()

    assert expire_unpublished_checkpoints(timezone.now() + timedelta(days=6)) == []  # within the 7 days
    assert all(resolve_model(alice.organization, name) is not None for name in names)  # still servable

    assert expire_unpublished_checkpoints(timezone.now() + timedelta(days=8)) == [job_id]
    assert not job.checkpoints.exists() and all(resolve_model(alice.organization, name) is None for name in names)
    assert all(store().version(name) is None for name in names)
    assert not (Path(settings.CONFIG.files_path) / storage.checkpoints_prefix(job_id)).exists()
    assert "Deleted its 2 checkpoint(s)" in job.events.values_list("message", flat=True).first()
    # A job that published its model keeps its checkpoints as long as the model.
    assert resolve_model(alice.organization, kept) is not None and store().version(kept) is not None
