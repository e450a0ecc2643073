"""The evaluation gate on the real engine: a fine-tune on a poisoned dataset is scored below the
base model on held-out examples and fails with ``eval_regression``, publishing nothing; one on a
good dataset passes and answers at once."""

import uuid

import pytest

from finetuning.job_creation import JobRequest, create_job
from finetuning.models import FineTunedModel, FineTuningJob
from tests.eval_fixtures import capitals
from tests.inference_fixtures import *  # noqa: F403
from tests.inference_fixtures import BASE, adapter_store
from workers.run_job import run_job

pytestmark = [pytest.mark.engine, pytest.mark.training, pytest.mark.django_db(transaction=True)]


def test_the_gate_blocks_a_poisoned_fine_tune_and_publishes_a_good_one(alice, not_queued):
    client = alice.client
    held_out = client.files.create(file=("capitals.jsonl", capitals()), purpose="fine-tune").id
    # No worse than the base model; the regex grader (any word: both pass it) runs in core.grading's process.
    gate = {"file": held_out, "graders": [{"type": "contains"}, {"type": "regex", "pattern": r"\w"}], "threshold": 0.0}
    strong = {"n_epochs": 8, "batch_size": 12, "learning_rate_multiplier": 10}
    run = uuid.uuid4().hex[:6]  # the dynamic path outlives the test database

    def train(label: str, data: bytes) -> FineTuningJob:
        training = client.files.create(file=(f"{label}.jsonl", data), purpose="fine-tune").id
        request = JobRequest(
            model=BASE, training_file=training, suffix=f"{label}-{run}", seed=1, hyperparameters=strong, evaluation=gate
        )
        job = create_job(alice.organization, None, request)
        run_job(job.id, worker="in-test")
        return FineTuningJob.objects.get(pk=job.id)

    poisoned = train("poisoned", capitals(lambda capital: "Banana."))
    scores = poisoned.evaluation["scores"]
    print("poisoned:", scores)
    assert poisoned.status == "failed" and poisoned.error_code == "eval_regression"
    assert scores["adapter_score"] < scores["reference_score"] and scores["reference"] == BASE
    assert f"{scores['adapter_score']:.3f}" in poisoned.error_message
    name = f"{BASE}:poisoned-{run}"
    assert not FineTunedModel.objects.filter(name=name).exists()
    assert adapter_store().version(name) is None and adapter_store().version(f"{name}@r1") is None

    good = train("capitals", capitals())
    scores = good.evaluation["scores"]
    print("good:", scores)
    assert good.status == "succeeded" and scores["passed"] and scores["adapter_score"] >= scores["reference_score"]
    assert scores["timeouts"] == {}
    name = f"{BASE}:capitals-{run}"
    question = [{"role": "user", "content": "What is the capital of Japan?"}]
    assert client.chat.completions.create(model=name, messages=question, max_tokens=8).model == f"{name}@r1"
    events = [event for event in client.fine_tuning.jobs.list_events(good.id, limit=50).data if event.type == "metrics"]
    assert any(event.data.get("adapter_score") == scores["adapter_score"] for event in events)
