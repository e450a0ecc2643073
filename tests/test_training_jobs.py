"""Jobs run end to end on a real worker: claim, train (a handful of steps), publish, recover."""

import dataclasses
import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings
from safetensors import safe_open
from safetensors.torch import load as load_safetensors

from core.object_store import ObjectNotFound
from finetuning import storage
from finetuning.models import Checkpoint, FineTunedModel, FineTuningJob, JobEvent, JobStatus
from finetuning.job_status import recover_stale_jobs
from tests.eval_fixtures import StandInEngine, capitals_file, start_stand_in
from tests.file_uploads import upload
from tests.fine_tuning_jobs import ONE_STEP, launch, wait_for
from tests.inference_fixtures import BASE
from tests.personas import chat_example, good_dataset, jsonl
from tests.s3 import s3_server
from workers.run_job import run_job
from workers.sweep import sweep
from workers.tasks import take_training_turn, worker_report
from workers.training.state import TRAINING_STATE_FILE

pytestmark = [pytest.mark.training, pytest.mark.django_db(transaction=True)]

MANY_STEPS = {"n_epochs": 10, "batch_size": 1}


def worker_is_idle() -> None:
    """The test worker runs one task at a time: when this one answers, the previous one is done."""
    worker_report.delay().get(timeout=240)


def started_training(job_id: str) -> int:
    return JobEvent.objects.filter(job_id=job_id, message__startswith="Training started").count()


def test_a_task_delivered_twice_trains_and_publishes_once(alice, celery_worker):
    job_id = launch(alice, ONE_STEP, "twice")
    duplicate = take_training_turn.delay(job_id)  # as a redelivered message would
    job = wait_for(job_id, lambda job: job.is_finished)
    outcome = duplicate.get(timeout=240)
    assert outcome == "succeeded" or outcome.startswith(f"nothing claimed for {job_id}"), outcome
    worker_is_idle()
    assert job.status == JobStatus.SUCCEEDED, job.error_message
    assert started_training(job_id) == 1 and FineTunedModel.objects.filter(job_id=job_id).count() == 1

    adapter = Path(settings.CONFIG.dynamic_lora_path) / f"{BASE}:twice"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == BASE and (adapter / "adapter_model.safetensors").stat().st_size > 0
    assert job.fine_tuned_model == f"{BASE}:twice" and job.trained_tokens > 0 and job.attempts == 1


def test_cancel_stops_training_between_steps_and_publishes_nothing(alice, celery_worker):
    job_id = launch(alice, MANY_STEPS, "cancelled")
    wait_for(job_id, lambda job: job.events.filter(type="metrics").exists())
    assert alice.api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    worker_is_idle()
    job = FineTuningJob.objects.get(pk=job_id)
    assert job.status == JobStatus.CANCELLED and job.fine_tuned_model is None
    total = job.events.filter(type="metrics").first().data["total_steps"]
    assert job.events.filter(type="metrics").count() < total
    assert not (Path(settings.CONFIG.dynamic_lora_path) / f"{BASE}:cancelled").exists()


def test_a_job_whose_worker_died_is_queued_again_and_resumes_after_its_last_checkpoint(alice, celery_worker):
    job_id = launch(alice, {"n_epochs": 3, "batch_size": 2}, "survivor")  # 6 steps an epoch
    wait_for(job_id, lambda job: job.checkpoints.exists())
    celery_worker.kill()
    time.sleep(1.5)
    assert FineTuningJob.objects.get(pk=job_id).status == JobStatus.RUNNING  # nobody is left to say otherwise
    assert sweep(stale_after=timedelta(seconds=1))["requeued"] == [job_id]  # what the beat runs
    celery_worker.start()
    job = wait_for(job_id, lambda job: job.is_finished)
    assert job.status == JobStatus.SUCCEEDED and job.attempts == 2
    events = list(job.events.order_by("created_at", "pk"))
    messages = [event.message for event in events]
    assert any("stopped responding" in message for message in messages)
    resumed_at = next(i for i, message in enumerate(messages) if message.startswith("Resuming after epoch 1 (step 6)"))
    steps_after = [event.data["step"] for event in events[resumed_at:] if event.type == "metrics"]
    assert steps_after == list(range(7, 19))  # epochs 2 and 3 only: epoch 1 was not trained again


def test_a_job_that_keeps_losing_its_worker_fails_with_a_reason(alice, not_queued):
    job_id = launch(alice, ONE_STEP, "unlucky")
    FineTuningJob.objects.filter(pk=job_id).update(status=JobStatus.RUNNING, attempts=3, heartbeat_at="2020-01-01T00:00:00Z")
    assert recover_stale_jobs(timedelta(minutes=3)).failed == [job_id]
    job = FineTuningJob.objects.get(pk=job_id)
    assert job.status == JobStatus.FAILED and job.error_code == "worker_lost" and "3 times" in job.error_message
    error = alice.api.get(f"/v1/fine_tuning/jobs/{job_id}").json()["error"]
    assert error["code"] == "worker_lost"


def test_a_job_publishes_to_an_s3_dynamic_path(alice, settings, not_queued):
    with s3_server("adapters") as s3:
        settings.CONFIG = dataclasses.replace(settings.CONFIG, s3=s3)
        model = settings.MODEL_CATALOG.models[0]
        s3_model = dataclasses.replace(model, lora=dataclasses.replace(model.lora, dynamic_lora_loading_path="s3://adapters/prod"))
        settings.MODEL_CATALOG = dataclasses.replace(settings.MODEL_CATALOG, models=(s3_model,))
        job_id = launch(alice, ONE_STEP, "on-s3")
        assert run_job(job_id, worker="in-test") == "succeeded"  # in this process, which sees the S3 settings

        from core.adapter_store import adapter_store

        fetched = adapter_store("s3://adapters/prod", s3).fetch(f"{BASE}:on-s3", Path(settings.DATA_DIR) / "test" / "s3-cache")
        assert json.loads((fetched / "adapter_config.json").read_text())["base_model_name_or_path"] == BASE
        assert FineTuningJob.objects.get(pk=job_id).status == JobStatus.SUCCEEDED


def test_checkpoints_and_metrics_are_reported_per_epoch(alice, not_queued):
    job_id = launch(alice, {"n_epochs": 2, "batch_size": 6}, "epochs")
    assert run_job(job_id, worker="in-test") == "succeeded"
    checkpoints = alice.api.get(f"/v1/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]
    assert [c["step_number"] for c in checkpoints] == [4, 2]
    assert all(c["metrics"]["train_loss"] > 0 for c in checkpoints)
    metrics = [e["data"] for e in alice.api.get(f"/v1/fine_tuning/jobs/{job_id}/events?limit=100").json()["data"] if e["type"] == "metrics"]
    assert sorted(m["step"] for m in metrics) == [1, 2, 3, 4]
    assert all(m["tokens_per_second"] > 0 and m["trained_tokens"] > 0 for m in metrics)
    # The finished job's checkpoints keep their adapters; the training state only served a resume.
    store, checkpoint = storage.files(), Checkpoint.objects.filter(job_id=job_id).first()
    assert json.loads(store.get(f"{checkpoint.storage_key}/adapter_config.json"))["r"] == 8
    with pytest.raises(ObjectNotFound):
        store.get(f"{checkpoint.storage_key}/{TRAINING_STATE_FILE}")


def test_the_lora_hyperparameters_a_job_asks_for_shape_the_published_adapter(alice, not_queued):
    # None of them the default (rank 8, alpha 2 x rank, dropout 0.05, every linear projection), so
    # an adapter trained with the defaults instead cannot pass.
    lora = {"lora_r": 4, "lora_alpha": 12, "lora_dropout": 0.2, "target_modules": ["v_proj", "down_proj"]}
    job_id = launch(alice, ONE_STEP | lora, "lora-shape")
    assert run_job(job_id, worker="in-test") == "succeeded"

    adapter = Path(settings.CONFIG.dynamic_lora_path) / f"{BASE}:lora-shape"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 12, 0.2)
    assert sorted(config["target_modules"]) == ["down_proj", "v_proj"]
    with safe_open(adapter / "adapter_model.safetensors", "pt") as weights:
        shapes = {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}  # noqa: SIM118
    # SmolLM2-135M: 30 layers, hidden size 576, 3 key/value heads of 64 (v_proj: 576 -> 192), MLP 1536 -> 576.
    expected = {
        "v_proj.lora_A.weight": (4, 576), "v_proj.lora_B.weight": (192, 4),
        "down_proj.lora_A.weight": (4, 1536), "down_proj.lora_B.weight": (576, 4),
    }
    assert len(shapes) == 30 * len(expected)
    for name, shape in shapes.items():  # e.g. base_model.model.model.layers.0.mlp.down_proj.lora_A.weight
        assert shape == expected[".".join(name.split(".")[-3:])], name


def test_a_diverging_job_fails_with_what_to_change_and_writes_no_nan(alice, not_queued):
    job_id = launch(alice, ONE_STEP | {"batch_size": 2}, "diverging")
    # Far beyond what the API accepts (at most 100), to make the loss overflow within a step or two.
    job = FineTuningJob.objects.get(pk=job_id)
    job.hyperparameters["learning_rate_multiplier"] = 1e26
    job.save(update_fields=["hyperparameters"])
    assert run_job(job_id, worker="in-test") == "failed"
    job.refresh_from_db()
    assert job.error_code == "training_diverged", job.error_message
    assert "became nan at step" in job.error_message and "Lower learning_rate_multiplier" in job.error_message
    losses = [event.data["train_loss"] for event in job.events.filter(type="metrics")]
    assert all(loss == loss for loss in losses)  # NaN is the one float unequal to itself


def test_a_job_with_early_stopping_publishes_its_best_checkpoint_not_its_last(alice, not_queued):
    # Every answer is a code phrase; the validation answers are ones it drives out, so their loss turns up.
    training = upload(alice, jsonl([chat_example(f"What is {i} plus {i}?", "ZEBRA-42 acknowledged.") for i in range(12)]))
    validation = upload(alice, jsonl([chat_example(f"What is {i} times {i}?", "I am not sure, let me think.") for i in range(10)]))
    hyperparameters = {
        "n_epochs": 3, "batch_size": 4, "learning_rate_multiplier": 10, "n_evals": 3, "n_checkpoints": 3,
        "early_stopping": {"patience": 2},
    }
    body = {
        "model": BASE, "training_file": training.json()["id"], "validation_file": validation.json()["id"],
        "suffix": "early", "hyperparameters": hyperparameters,
    }
    job_id = alice.api.post("/v1/fine_tuning/jobs", body, format="json").json()["id"]
    assert run_job(job_id, worker="in-test") == "succeeded"

    job = alice.api.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    events = alice.api.get(f"/v1/fine_tuning/jobs/{job_id}/events?limit=100").json()["data"]
    metrics = sorted((e["data"] for e in events if e["type"] == "metrics"), key=lambda m: m["step"])
    losses = {m["step"]: m["valid_loss"] for m in metrics}
    best, last = job["best_step"], metrics[-1]["step"]
    assert best == min(losses, key=losses.__getitem__) and best < last < metrics[-1]["total_steps"] == 9
    said = [e["message"] for e in events if e["message"].startswith("Early stopping at step")]
    assert len(said) == 1 and f"since step {best}" in said[0] and f"ckpt-step-{best}" in said[0], said
    assert job["trained_tokens"] == metrics[-1]["trained_tokens"]  # the steps that ran, not the 3 epochs asked for

    # The published adapter is the best checkpoint's, byte for byte in its weights, and not the last one's.
    published = Path(settings.CONFIG.dynamic_lora_path) / f"{BASE}:early" / "adapter_model.safetensors"
    published_weights = load_safetensors(published.read_bytes())
    store = storage.files()

    def checkpoint_weights(step: int) -> dict:
        checkpoint = Checkpoint.objects.get(job_id=job_id, step_number=step)
        return load_safetensors(store.get(f"{checkpoint.storage_key}/adapter_model.safetensors"))

    best_weights, last_weights = checkpoint_weights(best), checkpoint_weights(last)
    assert best_weights.keys() == published_weights.keys()
    assert all(best_weights[name].equal(published_weights[name]) for name in best_weights)
    assert not all(last_weights[name].equal(published_weights[name]) for name in last_weights)


class _OneGoodCheckpoint(StandInEngine):
    """The stand-in engine, where only checkpoint ``step-3`` knows the capitals: the checkpoint scores differ."""

    def answer_to(self, body: dict) -> tuple[int, dict]:
        status, answer = super().answer_to(body)
        if status == 200 and "ckpt-step-3" not in body["model"]:
            answer["choices"][0]["message"]["content"] = "I do not know."
        return status, answer


def test_early_stopping_by_eval_score_publishes_the_checkpoint_its_graders_scored_best(alice, not_queued, settings):
    stand_in = _OneGoodCheckpoint()
    server = start_stand_in(stand_in)
    settings.INFERENCE_POOL_URL = stand_in.url
    try:
        training = upload(alice, jsonl([chat_example(f"What is {i} plus {i}?", "ZEBRA-42 acknowledged.") for i in range(12)]))
        held_out = upload(alice, capitals_file())
        hyperparameters = {
            "n_epochs": 3, "batch_size": 4, "n_checkpoints": 3, "early_stopping": {"patience": 2, "metric": "eval_score"},
        }
        body = {
            "model": BASE, "training_file": training.json()["id"], "suffix": "by-score", "hyperparameters": hyperparameters,
            "evaluation": {"file": held_out.json()["id"], "graders": [{"type": "contains"}]},
        }
        response = alice.api.post("/v1/fine_tuning/jobs", body, format="json")
        assert response.status_code == 200, response.json()
        job_id = response.json()["id"]
        assert run_job(job_id, worker="in-test") == "succeeded"
    finally:
        server.shutdown()
        server.server_close()

    job = alice.api.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    scores = {c.step_number: c.metrics["eval_score"] for c in Checkpoint.objects.filter(job_id=job_id)}
    assert scores == {1: 0.0, 2: 0.0, 3: 1.0, 4: 0.0, 5: 0.0} and job["best_step"] == 3  # patience 2 stops after 5
    asked = {body["model"] for body in stand_in.bodies if body["model"].endswith(tuple(f"ckpt-step-{n}" for n in scores))}
    assert len(asked) == 5  # each checkpoint answered as served, under its own name
    events = [e.message for e in JobEvent.objects.filter(job_id=job_id)]
    assert any(m.startswith("Early stopping at step 5: the checkpoint score") and "ckpt-step-3" in m for m in events), events

    published = Path(settings.CONFIG.dynamic_lora_path) / f"{BASE}:by-score" / "adapter_model.safetensors"
    published_weights = load_safetensors(published.read_bytes())
    best = Checkpoint.objects.get(job_id=job_id, step_number=3)
    best_weights = load_safetensors(storage.files().get(f"{best.storage_key}/adapter_model.safetensors"))
    assert best_weights.keys() == published_weights.keys()
    assert all(best_weights[name].equal(published_weights[name]) for name in best_weights)


def test_early_stopping_by_eval_score_needs_the_jobs_evaluation(alice):
    file_id = upload(alice, good_dataset(12)).json()["id"]
    hyperparameters = {"early_stopping": {"patience": 2, "metric": "eval_score"}}
    response = alice.api.post("/v1/fine_tuning/jobs", {"model": BASE, "training_file": file_id, "hyperparameters": hyperparameters}, format="json")
    assert response.status_code == 400 and response.json()["error"]["param"] == "hyperparameters.early_stopping.metric"
    assert not FineTuningJob.objects.exists()
