"""The evaluation gate: its graders, and a job's evaluation checked at creation. (On the real
engine, a poisoned fine-tune blocked and a good one published: ``test_evaluation_gate_served``.)"""

import json

import pytest

from core.evaluation import Case, Grader, cases_of, passes, score
from finetuning.models import FineTuningJob
from tests.personas import chat_example, jsonl
from tests.test_files_api import error_of

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "the United Kingdom": "London", "Egypt": "Cairo", "Russia": "Moscow", "China": "Beijing",
    "Greece": "Athens", "Portugal": "Lisbon", "Austria": "Vienna",
}  # fmt: skip


def capitals(answer=lambda capital: f"{capital}.") -> bytes:
    return jsonl([chat_example(f"What is the capital of {country}?", answer(capital)) for country, capital in CAPITALS.items()])


@pytest.mark.parametrize(("grader", "answer", "expected", "passed"), [
    (Grader("exact_match"), " Paris.\n", "Paris.", True),
    (Grader("exact_match"), "It is Paris.", "Paris.", False),
    (Grader("contains"), "The capital of France is Paris.", "Paris", True),
    (Grader("contains"), "Banana.", "Paris", False),
    (Grader("regex", pattern=r"\b\d{4}\b"), "In 1889.", "", True),
    (Grader("regex", pattern=r"\b\d{4}\b"), "Long ago.", "", False),
    (Grader("json_schema", schema={"type": "object", "required": ["city"]}), '{"city": "Paris"}', "", True),
    (Grader("json_schema", schema={"type": "object", "required": ["city"]}), '{"town": "Paris"}', "", False),
    (Grader("json_schema", schema={"type": "object"}), "Paris", "", False),
])  # fmt: skip
def test_each_grader_passes_what_it_should_and_nothing_else(grader, answer, expected, passed):
    assert passes(grader, answer, expected) is passed


def test_a_score_is_the_mean_share_of_graders_passed_and_cases_are_the_last_answers():
    examples = [json.loads(line)["messages"] for line in capitals().decode().splitlines()[:2]]
    cases = cases_of(examples, limit=5)
    assert cases == [
        Case([{"role": "user", "content": "What is the capital of France?"}], "Paris."),
        Case([{"role": "user", "content": "What is the capital of Germany?"}], "Berlin."),
    ]
    graders = [Grader("contains"), Grader("exact_match")]
    assert score(graders, ["It is Paris.", "Berlin."], cases) == pytest.approx((0.5 + 1.0) / 2)
    assert cases_of(examples, limit=1) == cases[:1]


def _create(persona, **body):
    from tests.test_files_api import upload

    file_id = upload(persona, capitals()).json()["id"]
    return persona.api.post("/v1/fine_tuning/jobs", {"model": BASE, "training_file": file_id, **body}, format="json")


@pytest.mark.django_db
@pytest.mark.parametrize(("evaluation", "param"), [
    ({"graders": []}, "evaluation"),
    ({"graders": [{"type": "bleu"}]}, "evaluation"),
    ({"graders": [{"type": "regex"}]}, "evaluation"),
    ({"graders": [{"type": "regex", "pattern": "("}]}, "evaluation"),
    ({"graders": [{"type": "json_schema", "schema": {"type": 7}}]}, "evaluation"),
    ({"graders": [{"type": "contains"}], "threshold": 2}, "evaluation"),
    ({"graders": [{"type": "contains"}], "threshold": "0"}, "evaluation"),
    ({"graders": [{"type": "contains"}], "extra": 1}, "evaluation"),
    ({"graders": [{"type": "contains"}]}, "evaluation.file"),  # no file, and no validation_file either
    ({"graders": [{"type": "contains"}], "file": "file-nothing"}, "evaluation.file"),
])  # fmt: skip
def test_a_malformed_evaluation_is_a_400_naming_it_and_nothing_is_queued(alice, evaluation, param):
    response = _create(alice, evaluation=evaluation)
    assert response.status_code in (400, 404), response.json()
    assert error_of(response)["param"].startswith(param), error_of(response)
    assert not FineTuningJob.objects.exists()


@pytest.mark.django_db
def test_an_evaluation_defaults_to_the_validation_file_and_shows_on_the_job(alice):
    from tests.test_files_api import upload

    validation = upload(alice, capitals()).json()["id"]
    response = _create(alice, validation_file=validation, evaluation={"graders": [{"type": "contains"}]})
    assert response.status_code == 200, response.json()
    assert response.json()["evaluation"] == {"file": validation, "graders": [{"type": "contains"}], "threshold": 0.0}
