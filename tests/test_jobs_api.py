import pytest

from finetuning.models import FineTuningJob, JobStatus
from tests.file_uploads import error_of, upload
from tests.personas import good_dataset

pytestmark = pytest.mark.django_db

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture
def training_file(alice) -> str:
    return upload(alice, good_dataset(12)).json()["id"]


def create(persona, callbacks=None, **body):
    return persona.api.post("/v1/fine_tuning/jobs", body, format="json")


def test_it_creates_a_queued_job_and_enqueues_it_after_commit(alice, training_file, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks() as callbacks:
        response = create(alice, model=BASE, training_file=training_file, suffix="pirate", seed=7,
                          hyperparameters={"n_epochs": 2, "batch_size": "auto"}, metadata={"team": "nlp"})
    job = response.json()
    assert response.status_code == 200, job
    assert job["object"] == "fine_tuning.job" and job["id"].startswith("ftjob-")
    assert job["status"] == "queued" and job["model"] == BASE and job["suffix"] == "pirate" and job["seed"] == 7
    assert job["fine_tuned_model"] is None and job["error"] is None and job["metadata"] == {"team": "nlp"}
    assert job["hyperparameters"]["n_epochs"] == 2 and isinstance(job["hyperparameters"]["batch_size"], int)
    assert isinstance(job["created_at"], int) and job["training_file"] == training_file
    assert len(callbacks) == 1  # the Celery task, sent once the row is committed


def test_it_names_a_suffix_when_none_is_given(alice, training_file):
    suffix = create(alice, model=BASE, training_file=training_file).json()["suffix"]
    assert suffix.startswith("ft-") and len(suffix) > 3


def test_a_taken_suffix_is_refused_at_creation(alice, charlie, training_file):
    assert create(alice, model=BASE, training_file=training_file, suffix="bot").status_code == 200
    other_file = upload(charlie, good_dataset()).json()["id"]
    response = create(charlie, model=BASE, training_file=other_file, suffix="bot")
    assert response.status_code == 409
    assert error_of(response)["param"] == "suffix" and "is taken" in error_of(response)["message"]
    assert FineTuningJob.objects.count() == 1


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"model": "gpt-4o"}, "model", "cannot be fine-tuned here; choose one of: " + BASE),
        ({"training_file": "file-nope"}, "training_file", "No such file: 'file-nope'"),
        ({"validation_file": "file-nope"}, "validation_file", "No such file"),
        ({"suffix": "../../etc"}, "suffix", "letters, digits"),
        ({"suffix": "x" * 65}, "suffix", "letters, digits"),
        ({"seed": "7"}, "seed", "A valid integer is required"),
        ({"hyperparameters": {"n_epochs": "three"}}, "hyperparameters.n_epochs", '"auto" or a whole number from 1 to 50'),
        ({"hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs", "from 1 to 50"),
        ({"hyperparameters": {"learning_rate_multiplier": -1}}, "hyperparameters.learning_rate_multiplier", "a number"),
        ({"hyperparameters": {"lora_r": 64}}, "hyperparameters.lora_r", "exceeds"),
        ({"hyperparameters": {"target_modules": ["lm_head"]}}, "hyperparameters.target_modules", "unknown modules"),
        ({"hyperparameters": {"epochs": 3}}, "hyperparameters", "unknown parameter(s) epochs"),
        ({"temperature": 1}, None, "unknown parameter(s) temperature"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16 keys"),
        ({"method": {"type": "reinforcement"}}, "method.reinforcement", 'give {"grader": {...}}'),
        # A DPO job trains on preference pairs; this training file holds chat lines.
        ({"method": {"type": "dpo"}}, "training_file", "holds chat lines"),
        ({"hyperparameters": {"n_checkpoints": 10**6}}, "hyperparameters.n_checkpoints", "from 1 to 10"),
        ({"hyperparameters": {"n_evals": 0}}, "hyperparameters.n_evals", '"auto" or a whole number from 1 to 20'),
        ({"hyperparameters": {"n_evals": 2.5}}, "hyperparameters.n_evals", "whole number"),
        ({"hyperparameters": {"early_stopping": {"patience": -1}}}, "hyperparameters.early_stopping.patience", "greater than or equal to 1"),
        ({"hyperparameters": {"early_stopping": {"patience": "2"}}}, "hyperparameters.early_stopping.patience", "valid integer"),
        ({"hyperparameters": {"early_stopping": {"min_delta": 0.1}}}, "hyperparameters.early_stopping.patience", "required"),
        ({"hyperparameters": {"early_stopping": {"patience": 2, "min_delta": -0.1}}}, "hyperparameters.early_stopping.min_delta", "greater than or equal to 0"),
        ({"hyperparameters": {"early_stopping": {"patience": 2, "delta": 0.1}}}, "hyperparameters.early_stopping", "unknown parameter(s) delta"),
        ({"hyperparameters": {"early_stopping": 3}}, "hyperparameters.early_stopping", "Expected a dictionary"),
        # Early stopping watches the validation loss: without validation examples there is none.
        ({"hyperparameters": {"early_stopping": {"patience": 2}}}, "hyperparameters.early_stopping", "give a validation_file"),
    ],
)
def test_it_explains_a_bad_job_request_and_queues_nothing(alice, training_file, body, param, message, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks() as callbacks:
        response = create(alice, **{"model": BASE, "training_file": training_file, **body})
    error = error_of(response)
    assert response.status_code in (400, 404), error
    assert error["param"] == param and message in error["message"]
    assert not FineTuningJob.objects.exists() and not callbacks


def test_it_refuses_a_body_that_is_not_json(alice):
    response = alice.api.post("/v1/fine_tuning/jobs", "{oops", content_type="application/json")
    assert response.status_code == 400 and "could not parse" in error_of(response)["message"]
    response = alice.api.post("/v1/fine_tuning/jobs", [1, 2], format="json")
    assert response.status_code == 400 and "must be a JSON object" in error_of(response)["message"]


def test_hyperparameters_inside_method_are_honoured(alice, training_file):
    method = {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 4}}}
    assert create(alice, model=BASE, training_file=training_file, method=method).json()["hyperparameters"]["n_epochs"] == 4


def test_a_job_evaluates_and_checkpoints_once_an_epoch_without_early_stopping_unless_asked(alice, training_file):
    default = create(alice, model=BASE, training_file=training_file).json()["hyperparameters"]
    assert (default["n_evals"], default["n_checkpoints"], default["early_stopping"]) == (1, 1, None)
    hyperparameters = {"n_evals": 4, "n_checkpoints": "auto", "early_stopping": {"patience": 3}}
    job = create(alice, model=BASE, training_file=training_file, validation_file=training_file, hyperparameters=hyperparameters).json()
    asked = job["hyperparameters"]
    assert (asked["n_evals"], asked["n_checkpoints"]) == (4, 1)
    assert asked["early_stopping"] == {"patience": 3, "min_delta": 0.0, "metric": "valid_loss"}
    assert job["method"]["supervised"]["hyperparameters"] == asked and job["best_step"] is None


def test_early_stopping_inside_method_is_honoured_and_checked(alice, training_file):
    method = {"type": "supervised", "supervised": {"hyperparameters": {"early_stopping": {"patience": 2, "min_delta": 0.01}}}}
    job = create(alice, model=BASE, training_file=training_file, validation_file=training_file, method=method).json()
    assert job["hyperparameters"]["early_stopping"] == {"patience": 2, "min_delta": 0.01, "metric": "valid_loss"}
    method["supervised"]["hyperparameters"]["early_stopping"]["patience"] = 0
    response = create(alice, model=BASE, training_file=training_file, validation_file=training_file, method=method)
    assert response.status_code == 400 and "patience" in error_of(response)["param"]


def test_jobs_are_listed_newest_first_with_after_and_has_more(alice, training_file):
    ids = [create(alice, model=BASE, training_file=training_file).json()["id"] for _ in range(3)]
    page = alice.api.get("/v1/fine_tuning/jobs?limit=2").json()
    assert page["object"] == "list" and [j["id"] for j in page["data"]] == ids[::-1][:2] and page["has_more"]
    rest = alice.api.get(f"/v1/fine_tuning/jobs?limit=2&after={page['data'][-1]['id']}").json()
    assert [j["id"] for j in rest["data"]] == ids[:1] and not rest["has_more"]
    assert error_of(alice.api.get("/v1/fine_tuning/jobs?limit=0"))["param"] == "limit"


def test_cancel_stops_an_unfinished_job_once(alice, training_file):
    job_id = create(alice, model=BASE, training_file=training_file).json()["id"]
    cancelled = alice.api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").json()
    assert cancelled["status"] == "cancelled" and cancelled["finished_at"] is not None
    again = alice.api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
    assert again.status_code == 409 and "already cancelled" in error_of(again)["message"]
    messages = [e["message"] for e in alice.api.get(f"/v1/fine_tuning/jobs/{job_id}/events").json()["data"]]
    assert messages[0] == "Job cancelled by request" and any(m.startswith("Job queued") for m in messages)


def test_an_outsider_gets_404_for_every_job_endpoint(alice, bob, charlie, training_file):
    job_id = create(alice, model=BASE, training_file=training_file).json()["id"]
    assert bob.api.get(f"/v1/fine_tuning/jobs/{job_id}").status_code == 200
    for path in ("", "/events", "/checkpoints"):
        response = charlie.api.get(f"/v1/fine_tuning/jobs/{job_id}{path}")
        assert response.status_code == 404 and error_of(response)["message"] == f"No such fine-tuning job: '{job_id}'"
    assert charlie.api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").status_code == 404
    assert FineTuningJob.objects.get(pk=job_id).status == JobStatus.QUEUED
    assert charlie.api.get("/v1/fine_tuning/jobs").json()["data"] == []
    # charlie cannot train on alice's file either
    response = create(charlie, model=BASE, training_file=training_file)
    assert response.status_code == 404 and error_of(response)["param"] == "training_file"


def test_a_file_in_use_by_an_unfinished_job_cannot_be_deleted(alice, training_file):
    job_id = create(alice, model=BASE, training_file=training_file).json()["id"]
    response = alice.api.delete(f"/v1/files/{training_file}")
    assert response.status_code == 409 and job_id in error_of(response)["message"]
    alice.api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
    assert alice.api.delete(f"/v1/files/{training_file}").status_code == 200


def test_unknown_urls_answer_in_the_api_shape(alice):
    response = alice.api.get("/v1/fine_tuning/nothing")
    assert response.status_code == 404 and response.json()["error"]["code"] == "unknown_url"
