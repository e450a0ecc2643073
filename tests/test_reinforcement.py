"""Reinforcement fine-tuning jobs as OpenAI's API takes them: prompts files, the grader and the
hyperparameters checked before anything is queued; and the loop's arithmetic (group advantages, what
is trained on). The loop on the real engine: ``test_reinforcement_served``."""

from __future__ import annotations

import numpy as np
import pytest

from core.datasets import PROMPTS, PromptItem, parse_dataset
from finetuning.models import FineTuningJob
from tests.eval_fixtures import BASE
from tests.file_uploads import error_of, upload
from tests.personas import good_dataset, prompts_dataset
from workers.training_loop.losses import ADVANTAGES, SAMPLING_LOGPROBS, TARGET_TOKENS
from workers.training_loop.reinforcement import Answer, _advantages, _datum

GRADER = {
    "type": "text_similarity", "name": "close", "evaluation_metric": "fuzzy_match",
    "input": "{{sample.output_text}}", "reference": "{{item.reference_answer}}",
}


def test_a_line_of_messages_without_a_reply_is_a_prompt_that_keeps_its_fields_for_the_grader():
    dataset = parse_dataset(prompts_dataset(3), min_examples=1)
    assert dataset.ok and dataset.format == PROMPTS
    first = dataset.examples[0]
    assert isinstance(first, PromptItem) and [m["role"] for m in first.prompt] == ["user"]
    assert first.item["reference_answer"] == "0" and first.item["messages"][0]["content"] == "What is 0 plus 0?"


def test_a_prompt_in_a_chat_file_is_a_reply_forgotten_named_by_its_line():
    lines = good_dataset(11) + prompts_dataset(1)
    dataset = parse_dataset(lines, min_examples=1)
    assert [error.line for error in dataset.errors] == [12]
    assert "needs at least one assistant message" in dataset.errors[0].message


def create(persona, training_file: str, reinforcement: dict | None = None, **body):
    method = {"type": "reinforcement", "reinforcement": {"grader": GRADER} | (reinforcement or {})}
    return persona.api.post("/v1/fine_tuning/jobs", {"model": BASE, "training_file": training_file, "method": method} | body, format="json")


@pytest.fixture
def prompts_file(alice) -> str:
    return upload(alice, prompts_dataset(16)).json()["id"]


@pytest.mark.django_db
def test_a_reinforcement_job_resolves_openais_hyperparameters_and_echoes_its_grader(alice, prompts_file):
    response = create(alice, prompts_file, {"hyperparameters": {"compute_multiplier": 2, "n_epochs": 2}})
    job = response.json()
    assert response.status_code == 200, job
    settings = job["method"]["reinforcement"]
    hp = settings["hyperparameters"]
    assert settings["grader"] == GRADER and job["method"]["type"] == "reinforcement"
    assert hp["samples_per_prompt"] == 8 and hp["batch_size"] == 2 and hp["n_epochs"] == 2
    assert hp["eval_interval"] == 4 and hp["eval_samples"] == 1 and hp["reasoning_effort"] == "default"  # 16 steps: 4 evaluations
    assert FineTuningJob.objects.get(pk=job["id"]).grader == GRADER
    assert "16 prompts" in alice.api.get(f"/v1/fine_tuning/jobs/{job['id']}/events").json()["data"][-1]["message"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("reinforcement", "body", "param", "message"),
    [
        ({"grader": {"type": "python", "name": "mine", "source": "def grade(s, i): return 1"}}, {},
         "method.reinforcement.grader.type", "python"),
        ({"grader": GRADER | {"pass_threshold": 0.5}}, {}, "method.reinforcement.grader", "pass_threshold"),
        ({"grader": GRADER | {"evaluation_metric": "cosine"}}, {}, "method.reinforcement.grader.evaluation_metric", "cosine"),
        ({"grader": "close"}, {}, "method.reinforcement.grader", "grader object"),
        ({"hyperparameters": {"reasoning_effort": "medium"}}, {}, "hyperparameters.reasoning_effort", "does not reason"),
        ({"hyperparameters": {"beta": 0.1}}, {}, "method.reinforcement.hyperparameters", "unknown parameter(s) beta"),
        ({"hyperparameters": {"compute_multiplier": 1e308}}, {}, "method.reinforcement.hyperparameters.compute_multiplier", "a number"),
        ({"hyperparameters": {"max_completion_tokens": 4000}}, {}, "hyperparameters.max_completion_tokens", "takes at most"),
        ({}, {"hyperparameters": {"lora_dropout": 0.1}}, "hyperparameters.lora_dropout", "not a reinforcement hyperparameter"),
        ({}, {"evaluation": {"graders": [{"type": "contains"}]}}, "evaluation", "leave evaluation out"),
        ({"grader": {"type": "score_model", "name": "judge", "model": f"{BASE}:nobodys",
                     "input": [{"role": "user", "content": "{{sample.output_text}}"}]}}, {}, "method.reinforcement.grader.model", "nobodys"),
    ],
)
def test_a_bad_reinforcement_job_is_refused_naming_its_field_and_nothing_is_queued(alice, prompts_file, reinforcement, body, param, message):
    response = create(alice, prompts_file, reinforcement, **body)
    assert 400 <= response.status_code < 500, response.json()
    error = error_of(response)
    assert error["param"].startswith(param) and message in error["message"], error
    assert FineTuningJob.objects.count() == 0


@pytest.mark.django_db
def test_reinforcement_trains_on_prompts_files_and_the_others_say_which_method_takes_them(alice, prompts_file):
    chat = upload(alice, good_dataset(12)).json()["id"]
    error = error_of(create(alice, chat))
    assert error["param"] == "training_file" and "the reinforcement method trains on prompts lines" in error["message"]
    response = alice.api.post("/v1/fine_tuning/jobs", {"model": BASE, "training_file": prompts_file}, format="json")
    assert 'method {"type": "reinforcement"}' in error_of(response)["message"]


def test_each_answer_is_scored_against_its_siblings_and_a_group_that_scored_alike_teaches_nothing():
    answer = Answer("x", [1], [0.0])
    advantages = _advantages([[answer] * 4, [answer] * 2], [1.0, 0.0, 0.0, 1.0, 0.5, 0.5])
    assert np.allclose(advantages[:4], [1, -1, -1, 1]) and advantages[4:] == [0.0, 0.0]


def test_only_the_answers_tokens_are_trained_with_the_samplers_logprobs():
    datum = _datum([10, 11, 12], Answer(" yes", [20, 21], [-0.5, float("-inf")]))
    assert datum.tokens == [10, 11, 12, 20]  # the last token is only a target
    assert datum.inputs[TARGET_TOKENS].tolist() == [11, 12, 20, 21]
    assert datum.inputs[SAMPLING_LOGPROBS].tolist() == [0.0, 0.0, -0.5, -100.0]  # -inf would make the ratio NaN
    assert datum.inputs[ADVANTAGES].tolist() == [0.0] * 4  # the caller's to fill in
