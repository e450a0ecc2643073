"""The models page names the revision each model answers with, and rolls it back with one button."""

import json

import pytest
from django.conf import settings
from django.urls import reverse

from core.adapter_store import adapter_store
from finetuning.models import FineTunedModel, FineTuningJob, ModelRevision
from tests.inference_fixtures import register_fine_tuned_model

pytestmark = pytest.mark.django_db

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture
def alice_web(client, alice):
    client.force_login(alice.user)
    return client


def _adapter(folder, weights: bytes):
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "base_model_name_or_path": BASE}))
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


@pytest.fixture
def two_revisions(alice, tmp_path) -> str:
    """alice's model with r1 and r2 published, answering with r2."""
    name = register_fine_tuned_model(alice, "support")
    model = FineTunedModel.objects.get(name=name)
    second_job = FineTuningJob.objects.create(
        organization=alice.organization, model=BASE, parent_model=name, training_file="file-gone", suffix="support",
        revision=2, seed=0, hyperparameters={}, status="succeeded", fine_tuned_model=name,
    )
    ModelRevision.objects.create(model=model, number=2, job=second_job, final_loss=0.25)
    store = adapter_store(settings.CONFIG.dynamic_lora_path, settings.CONFIG.s3)
    store.publish(name, _adapter(tmp_path / "r1", b"one"), 1)
    store.publish(name, _adapter(tmp_path / "r2", b"two"), 2)
    FineTunedModel.objects.filter(pk=model.pk).update(revision=2)
    return name


def _row(page: str, name: str) -> str:
    row = page[page.index(f'data-model="{name}"'):]
    return row[: row.index("</tr>")]


def test_the_models_page_names_the_current_revision_and_answers_with_another_at_a_click(alice_web, two_revisions):
    name = two_revisions
    row = _row(alice_web.get(reverse("dashboard:models")).content.decode(), name)
    assert '<span class="revision"' in row and ">r2</span>" in row
    assert "loss 0.2500" in row and f'action="/models/{name}/rollback"' in row

    answer = alice_web.post(reverse("dashboard:model_rollback", args=[name]), {"revision": "1"}, follow=True)
    assert f"{name} answers with r1 from now on." in answer.content.decode()
    assert FineTunedModel.objects.get(name=name).revision == 1
    store = adapter_store(settings.CONFIG.dynamic_lora_path, settings.CONFIG.s3)
    assert store.version(name).version == "r1"  # what the pool serves from the next request on


@pytest.mark.parametrize("revision", ["7", "", "r1"])
def test_a_rollback_to_no_such_revision_is_shown_on_the_page_and_changes_nothing(alice_web, two_revisions, revision):
    answer = alice_web.post(reverse("dashboard:model_rollback", args=[two_revisions]), {"revision": revision}, follow=True)
    assert answer.status_code == 200 and 'class="flash error"' in answer.content.decode()
    assert FineTunedModel.objects.get(name=two_revisions).revision == 2


def test_another_organizations_model_cannot_be_rolled_back(client, charlie, two_revisions):
    client.force_login(charlie.user)
    response = client.post(reverse("dashboard:model_rollback", args=[two_revisions]), {"revision": "1"})
    assert response.status_code == 404 and FineTunedModel.objects.get(name=two_revisions).revision == 2


def test_the_job_page_shows_each_checkpoint_by_the_name_it_answers_to_and_the_gates_scores_side_by_side(alice_web, alice):
    from finetuning.models import Checkpoint

    job = FineTuningJob.objects.create(
        organization=alice.organization, model=BASE, training_file="file-gone", suffix="gated", seed=0, hyperparameters={},
        status="failed", error_code="eval_regression",
        evaluation={"file": "file-held", "graders": [{"type": "contains"}], "threshold": -0.1, "scores": {
            "reference": BASE, "reference_score": 0.75, "adapter": f"{BASE}:gated@r1", "adapter_score": 0.125,
            "threshold": -0.1, "examples": 8, "passed": False,
        }},
    )
    Checkpoint.objects.create(job=job, step_number=3, epoch=1, metrics={}, storage_key="gone")
    page = alice_web.get(reverse("dashboard:job", args=[job.id])).content.decode()
    section = page[page.index('id="evaluation"'):]
    section = section[: section.index("</section>")]
    for shown in (BASE, "0.750", f"{BASE}:gated@r1", "0.125", "not published", "8 held-out examples", "<code>contains</code>"):
        assert shown in section, shown
    assert f"<code>{BASE}:gated:ckpt-step-3</code>" in page
    playground = alice_web.get(reverse("dashboard:playground"), {"model": f"{BASE}:gated:ckpt-step-3"}).content.decode()
    assert f'<option value="{BASE}:gated:ckpt-step-3" selected>' in playground  # a checkpoint opens in the playground


def test_the_progress_feed_leaves_the_evaluation_scores_out_of_the_loss_curve_but_counts_them_seen(alice_web, alice):
    from finetuning.models import record_event

    job = FineTuningJob.objects.create(
        organization=alice.organization, model=BASE, training_file="file-gone", suffix="fed", seed=0, hyperparameters={}
    )
    record_event(job, "Step 1/1: training loss=1.0", data={"step": 1, "total_steps": 1, "epoch": 1, "train_loss": 1.0})
    record_event(job, "Evaluation: ...", data={"reference": BASE, "reference_score": 0.5, "adapter_score": 0.75})
    body = alice_web.get(reverse("dashboard:job_progress", args=[job.id])).json()
    assert [report["step"] for report in body["metrics"]] == [1] and body["metrics_count"] == 2


def test_a_continued_jobs_pages_name_the_model_it_goes_on_from_and_the_revision_it_publishes(alice_web, two_revisions):
    job = FineTuningJob.objects.get(revision=2)
    page = alice_web.get(reverse("dashboard:job", args=[job.id])).content.decode()
    assert f"from <code>{two_revisions}</code>, publishing r2" in page
    assert f"<td>{two_revisions}</td>" in alice_web.get(reverse("dashboard:jobs")).content.decode()


def test_a_member_rolls_back_only_where_an_owner_lets_members_manage_as_for_deleting(client, alice, bob, two_revisions):
    """Rolling back changes what everyone's requests answer with, as deleting does: the same rule."""
    client.force_login(bob.user)
    assert f'action="/models/{two_revisions}/rollback"' not in client.get(reverse("dashboard:models")).content.decode()
    page = client.post(reverse("dashboard:model_rollback", args=[two_revisions]), {"revision": "1"})
    api = bob.api.post(f"/v1/fine_tuning/models/{two_revisions}/rollback", {"revision": 1}, format="json")
    assert page.status_code == 403 and "only an owner" in page.content.decode().lower()
    assert api.status_code == 403 and api.json()["error"]["code"] == "permission_denied", api.json()
    assert FineTunedModel.objects.get(name=two_revisions).revision == 2
    assert adapter_store(settings.CONFIG.dynamic_lora_path, settings.CONFIG.s3).version(two_revisions).version == "r2"

    alice.organization.members_may_manage = True
    alice.organization.save()
    assert f'action="/models/{two_revisions}/rollback"' in client.get(reverse("dashboard:models")).content.decode()
    assert client.post(reverse("dashboard:model_rollback", args=[two_revisions]), {"revision": "1"}).status_code == 302
    assert FineTunedModel.objects.get(name=two_revisions).revision == 1
    api = bob.api.post(f"/v1/fine_tuning/models/{two_revisions}/rollback", {"revision": 2}, format="json")
    assert api.status_code == 200 and FineTunedModel.objects.get(name=two_revisions).revision == 2
