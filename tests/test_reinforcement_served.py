"""Reinforcement fine-tuning on the real engine: a job created with the official ``openai`` client as
OpenAI's RFT guide writes it (prompts-only lines, a ``text_similarity`` grader reading
``{{item.reference_answer}}``), trained by a worker here: the reward rises, each step's metrics are
events, checkpoints answer while it trains, and the published model beats the base model on the
held-out prompts under the same grader."""

import json
import uuid

import pytest

from finetuning.models import FineTuningJob
from tests.inference_fixtures import *  # noqa: F403
from tests.inference_fixtures import BASE, adapter_store
from workers.run_job import run_job

pytestmark = [pytest.mark.engine, pytest.mark.training, pytest.mark.django_db(transaction=True)]

QUESTIONS = [
    "Is the sky blue on a clear day?", "Is water wet?", "Do fish live in water?", "Is fire hot?",
    "Is snow cold?", "Do birds have feathers?", "Is the sun bright?", "Is grass green?",
    "Do cats have four legs?", "Is ice frozen water?", "Is honey sweet?", "Do trees have leaves?",
    "Is the ocean salty?", "Do cows give milk?", "Is a lemon sour?", "Is the moon round?",
    "Do dogs bark?", "Is sugar sweet?", "Is rain wet?", "Do bees make honey?", "Is coal black?", "Do ducks swim?",
]  # fmt: skip
GRADER = {
    "type": "text_similarity", "name": "says yes", "evaluation_metric": "fuzzy_match",
    "input": "{{sample.output_text}}", "reference": "{{item.reference_answer}}",
}  # fmt: skip


def prompts_file(questions: list[str]) -> bytes:
    """OpenAI's RFT lines: the conversation to answer, and the field the grader reads."""
    lines = [
        {"messages": [{"role": "user", "content": f"{question} Answer yes or no."}], "reference_answer": "Yes"}
        for question in questions
    ]  # fmt: skip
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def test_a_reinforcement_job_raises_its_reward_and_beats_the_base_model(alice, not_queued):
    client = alice.client
    training = client.files.create(file=("train.jsonl", prompts_file(QUESTIONS[:12])), purpose="fine-tune").id
    validation = client.files.create(file=("valid.jsonl", prompts_file(QUESTIONS[12:])), purpose="fine-tune").id
    suffix = f"says-yes-{uuid.uuid4().hex[:6]}"  # the dynamic path outlives the test database
    job = client.fine_tuning.jobs.create(
        model=BASE, training_file=training, validation_file=validation, suffix=suffix, seed=3,
        method={"type": "reinforcement", "reinforcement": {"grader": GRADER, "hyperparameters": {
            "n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 2, "eval_interval": 3, "eval_samples": 2,
            "max_completion_tokens": 8,
        }}},
    )  # fmt: skip
    assert job.method.type == "reinforcement" and job.method.reinforcement.grader.type == "text_similarity"
    assert job.hyperparameters.samples_per_prompt == 4  # type: ignore[attr-defined]  # compute_multiplier "auto": 1

    run_job(job.id, worker="in-test")
    done = FineTuningJob.objects.get(pk=job.id)
    assert done.status == "succeeded", done.error_message
    events = client.fine_tuning.jobs.list_events(job.id, limit=100).data
    metrics = sorted((e.data for e in events if e.type == "metrics" and e.data and "step" in e.data), key=lambda d: d["step"])
    steps = [m for m in metrics if m["step"] > 0]
    print("rewards:", [round(m["reward_mean"], 3) for m in steps], "validation:", [(m["step"], round(m["valid_reward"], 3)) for m in metrics if "valid_reward" in m])
    assert [m["step"] for m in steps] == list(range(1, 7))
    assert all(0.0 <= m["pass_rate"] <= 1.0 and m["samples_per_second"] > 0 for m in steps)
    first, last = steps[0]["reward_mean"] + steps[1]["reward_mean"], steps[-2]["reward_mean"] + steps[-1]["reward_mean"]
    assert last > first
    base = metrics[0]
    assert base["step"] == 0 and "valid_reward" in base  # the base model's answers, scored before training
    assert done.best_step is not None and done.best_step > 0
    best = next(m for m in metrics if m["step"] == done.best_step)
    assert best["valid_reward"] > base["valid_reward"]

    # Checkpoints answered while it trained; the job's own serving revisions are gone.
    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert sorted(c.step_number for c in checkpoints) == [3, 6]
    assert adapter_store().version(f"{BASE}:rft-{job.id.partition('-')[2].lower()}") is None
    answer = client.chat.completions.create(
        model=done.fine_tuned_model, messages=[{"role": "user", "content": "Is milk white? Answer with one word."}], max_tokens=8
    )  # fmt: skip
    print("answer:", answer.choices[0].message.content)
    assert answer.model.startswith(f"{BASE}:{suffix}")
