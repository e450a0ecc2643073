"""Evals written as OpenAI's evals guide writes them, through the official client, unchanged: a custom
item schema, items as ``file_content`` and as a file of purpose ``evals``, an ``input_messages``
template over ``{{item.*}}``, graders on item fields (string_check, text_similarity, a label_model
judged by a model served here), a ``jsonl`` run of samples given in advance; and
``fine_tuning.alpha.graders.run`` / ``.validate``. The serving backend is the stand-in
(``tests.eval_fixtures``: it knows the capitals only as a fine-tune, and judges under structured
outputs as a judge would); the real engine's runs are in the running-product test."""

# ruff: noqa: F811 (pytest fixtures are imported from tests.eval_fixtures, then named as arguments)
from __future__ import annotations

import json
import threading

import openai
import pytest

from evals.models import EvalRun
from tests.eval_fixtures import BASE, CAPITALS, engine, queued  # noqa: F401 (fixtures)
from tests.inference_fixtures import register_fine_tuned_model
from tests.personas import jsonl
from workers.grade_sample import grade_sample
from workers.run_eval import run_eval

pytestmark = pytest.mark.django_db(transaction=True)  # the live server reads the database in its own thread

# The guide's shapes: an item schema of the fields the items hold, a template, graders on item fields.
ITEM_SCHEMA = {
    "type": "object",
    "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
    "required": ["country", "capital"],
}
TEMPLATE = {"type": "template", "template": [
    {"role": "developer", "content": "Answer with the capital city only."},
    {"role": "user", "content": "What is the capital of {{item.country}}?"},
]}
STRING_CHECK = {"type": "string_check", "name": "names the capital", "input": "{{sample.output_text}}",
                "reference": "{{item.capital}}", "operation": "ilike"}
SIMILARITY = {"type": "text_similarity", "name": "close to the capital", "input": "{{sample.output_text}}",
              "reference": "{{item.capital}}.", "evaluation_metric": "fuzzy_match", "pass_threshold": 0.8}
JUDGE = {"type": "label_model", "name": "judge", "model": BASE, "labels": ["correct", "incorrect"], "passing_labels": ["correct"],
         "input": [{"role": "user", "content": "Is {{sample.output_text}} the capital of {{item.country}}?"}]}
ITEMS = [{"item": {"country": country, "capital": capital}} for country, capital in CAPITALS.items()]


@pytest.fixture
def worker_grades(monkeypatch):
    """graders.run's task, graded by ``workers.grade_sample`` on a thread as a worker would."""

    def send(task, *args):
        threading.Thread(target=grade_sample, args=(args[0], int(args[1]), args[2]), daemon=True).start()

    monkeypatch.setattr("evals.grader_runs.send", send)


def client_for(persona, live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=persona.key, max_retries=0)


def _guide_eval(client: openai.OpenAI, criteria: list[dict]):
    return client.evals.create(
        name="capitals", data_source_config={"type": "custom", "item_schema": ITEM_SCHEMA, "include_sample_schema": True},
        testing_criteria=criteria,
    )


def test_an_eval_written_as_the_guide_writes_it_scores_a_fine_tune_above_the_base_model(alice, live_server, engine, queued):
    client = client_for(alice, live_server)
    fine_tune = register_fine_tuned_model(alice, "capitals")
    evaluation = _guide_eval(client, [STRING_CHECK, SIMILARITY, JUDGE])
    schema = evaluation.data_source_config.schema_
    assert schema["properties"]["item"] == ITEM_SCHEMA and "sample" in schema["properties"]

    evals_file = client.files.create(file=("capitals.jsonl", jsonl(ITEMS)), purpose="evals")
    runs = {}
    for model, source in ((BASE, {"type": "file_content", "content": ITEMS}), (fine_tune, {"type": "file_id", "id": evals_file.id})):
        run = client.evals.runs.create(
            evaluation.id, name=model, data_source={"type": "completions", "model": model, "source": source, "input_messages": TEMPLATE,
                                                     "sampling_params": {"temperature": 0, "max_completion_tokens": 16}},
        )
        runs[model] = run.id
    assert [run_eval(run_id, "test-worker") for run_id in queued] == ["completed", "completed"]

    asked = [body for body in engine.bodies if "response_format" not in body]  # a batch's come in any order
    france = next(body for body in asked if body["messages"][-1]["content"].endswith("France?"))
    assert france["messages"] == [
        {"role": "system", "content": "Answer with the capital city only."}, {"role": "user", "content": "What is the capital of France?"}
    ]  # a developer message is sent as system: the served models' templates know that role
    judged = [body for body in engine.bodies if "response_format" in body]
    assert len(judged) == 2 * len(ITEMS)  # one verdict an answer: asked ahead for a batch, never again
    assert {body["model"] for body in judged} == {BASE}
    assert "Is I do not know. the capital of France?" in {body["messages"][-1]["content"] for body in judged}

    base, tuned = (client.evals.runs.retrieve(runs[model], eval_id=evaluation.id) for model in (BASE, fine_tune))
    per_criterion = {r.testing_criteria: (r.passed, r.failed) for r in tuned.per_testing_criteria_results}
    assert per_criterion == {"names the capital": (5, 0), "close to the capital": (5, 0), "judge": (5, 0)}
    assert tuned.result_counts.passed == 5 and base.result_counts.passed == 0
    assert {r.testing_criteria: r.passed for r in base.per_testing_criteria_results}["names the capital"] == 0

    (item,) = client.evals.runs.output_items.list(runs[fine_tune], eval_id=evaluation.id, limit=1).data
    assert item.datasource_item in [entry["item"] for entry in ITEMS]
    by_name = {result.name: result for result in item.results}
    assert by_name["close to the capital"].score == pytest.approx(1.0) and by_name["judge"].sample["label"] == "correct"


def test_an_eval_whose_judge_is_not_the_callers_is_a_404_naming_it(alice, charlie):
    theirs = register_fine_tuned_model(charlie, "their-judge")
    body = {"data_source_config": {"type": "custom", "item_schema": ITEM_SCHEMA}, "testing_criteria": [JUDGE | {"model": theirs}]}
    response = alice.api.post("/v1/evals", body, format="json")
    assert response.status_code == 404 and response.json()["error"]["param"] == "testing_criteria.0.model", response.json()


def test_a_run_whose_judge_was_deleted_since_the_eval_was_made_fails_naming_it(alice, live_server, engine, queued):
    client = client_for(alice, live_server)
    judge = register_fine_tuned_model(alice, "judge")
    evaluation = _guide_eval(client, [JUDGE | {"model": judge}])
    assert client.models.delete(judge).deleted
    run = client.evals.runs.create(evaluation.id, data_source={"type": "jsonl", "source": {"type": "file_content", "content": [
        {**ITEMS[0], "sample": {"output_text": "Paris"}}]}})
    assert run_eval(run.id, "test-worker") == "failed" and engine.bodies == []
    failed = client.evals.runs.retrieve(run.id, eval_id=evaluation.id)
    assert failed.error.code == "model_not_found" and judge in failed.error.message


def test_a_jsonl_run_grades_the_samples_its_items_bring_and_asks_no_model(alice, live_server, engine, queued):
    client = client_for(alice, live_server)
    evaluation = _guide_eval(client, [STRING_CHECK])
    given = [{**entry, "sample": {"output_text": entry["item"]["capital"] if index % 2 else "Lyon"}} for index, entry in enumerate(ITEMS)]
    run = client.evals.runs.create(evaluation.id, data_source={"type": "jsonl", "source": {"type": "file_content", "content": given}})
    assert run_eval(run.id, "test-worker") == "completed" and engine.bodies == []
    done = client.evals.runs.retrieve(run.id, eval_id=evaluation.id)
    assert (done.result_counts.passed, done.result_counts.failed) == (2, 3)


@pytest.mark.parametrize(("source", "param", "says"), [
    ({"type": "file_content", "content": [ITEMS[0], {"item": {"country": "Peru"}}]}, "data_source.source.content.1.item",
     "'capital' is a required property"),
    ({"type": "file_content", "content": [{"item": {"country": "Peru", "capital": 7}}]}, "data_source.source.content.0.item.capital",
     "is not of type 'string'"),
    ({"type": "file_content", "content": [{"item": "Peru"}]}, "data_source.source.content.0", "item must be a JSON object"),
    ({"type": "file_content", "content": ITEMS * 101}, "data_source.source.content", "at most 500"),
    ({"type": "file_content", "content": []}, "data_source.source.content", "at least one item"),
])
def test_a_run_whose_items_do_not_fit_the_item_schema_is_refused_naming_the_item(alice, queued, source, param, says):
    evaluation = alice.api.post("/v1/evals", {"data_source_config": {"type": "custom", "item_schema": ITEM_SCHEMA},
                                              "testing_criteria": [STRING_CHECK]}, format="json")
    assert evaluation.status_code == 200, evaluation.json()
    data_source = {"type": "completions", "model": BASE, "source": source, "input_messages": TEMPLATE}
    response = alice.api.post(f"/v1/evals/{evaluation.json()['id']}/runs", {"data_source": data_source}, format="json")
    assert response.status_code == 400, response.json()
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert not EvalRun.objects.exists() and queued == []


def test_an_evals_file_is_checked_line_by_line_at_upload(alice):
    lines = b'{"item": {"country": "Peru", "capital": "Lima"}}\n{"item": "Peru"}\n{"itme": {}}\n{"item": {"n": NaN}}\n'
    response = alice.api.post("/v1/files", {"file": _named(lines), "purpose": "evals"}, format="multipart")
    assert response.status_code == 400, response.json()
    assert [error["line"] for error in response.json()["error"]["errors"]] == [2, 3, 4]


def _named(data: bytes):
    from django.core.files.uploadedfile import SimpleUploadedFile

    return SimpleUploadedFile("items.jsonl", data)


def test_an_evals_file_is_not_a_training_file(alice):
    evals_file = alice.api.post("/v1/files", {"file": _named(jsonl(ITEMS)), "purpose": "evals"}, format="multipart").json()
    response = alice.api.post("/v1/fine_tuning/jobs", {"model": BASE, "training_file": evals_file["id"]}, format="json")
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_file_purpose", response.json()


def test_graders_run_scores_a_sample_as_the_clients_guide_calls_it(alice, live_server, engine, worker_grades):
    client = client_for(alice, live_server)
    item = {"country": "France", "capital": "Paris"}
    checked = client.fine_tuning.alpha.graders.run(grader=STRING_CHECK, model_sample="paris", item=item)
    assert checked.reward == 1.0 and checked.metadata.type == "string_check"
    close = {k: v for k, v in SIMILARITY.items() if k != "pass_threshold"}  # graders.run's grader has none (OpenAI's type)
    similar = client.fine_tuning.alpha.graders.run(grader=close, model_sample="Pariss.", item=item)
    assert 0.8 < similar.reward < 1.0
    multi = {"type": "multi", "name": "both", "calculate_output": "0.5 * exact + 0.5 * close",
             "graders": {"exact": STRING_CHECK | {"operation": "eq"}, "close": close}}
    mixed = client.fine_tuning.alpha.graders.run(grader=multi, model_sample="Paris.", item=item)
    assert mixed.reward == pytest.approx(0.5 * 0.0 + 0.5 * 1.0) and set(mixed.sub_rewards) == {"exact", "close"}
    judged = client.fine_tuning.alpha.graders.run(
        grader={"type": "score_model", "name": "judge", "model": BASE, "range": [0, 10],
                "input": [{"role": "user", "content": "Score {{sample.output_text}} for {{item.country}}"}]},
        model_sample="Paris", item=item,
    )
    assert judged.reward == 10 and engine.background[-1]  # the judge's request is background work


@pytest.mark.parametrize(("grader", "param", "code"), [
    (STRING_CHECK | {"operation": "sounds_like"}, "grader.operation", "invalid_grader"),
    (SIMILARITY | {"evaluation_metric": "cosine"}, "grader.evaluation_metric", "grader_not_offered"),
    ({"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 1"}, "grader.type", "grader_not_offered"),
    (JUDGE | {"model": f"{BASE}:nobodys"}, "grader.model", "model_not_found"),
    (JUDGE | {"passing_labels": ["maybe"]}, "grader.passing_labels", "invalid_grader"),
])
def test_graders_validate_refuses_a_malformed_grader_naming_the_field(alice, live_server, grader, param, code):
    client = client_for(alice, live_server)
    fine = client.fine_tuning.alpha.graders.validate(grader=STRING_CHECK)
    assert fine.grader.type == "string_check"
    with pytest.raises(openai.APIStatusError) as refused:
        client.fine_tuning.alpha.graders.validate(grader=grader)
    error = refused.value.body
    assert refused.value.status_code in (400, 404) and error["param"] == param and error["code"] == code, error
    body = json.dumps({"grader": grader, "model_sample": "x"})
    assert alice.api.post("/v1/fine_tuning/alpha/graders/run", body, content_type="application/json").status_code in (400, 404)


def test_a_jobs_gate_takes_openais_graders_and_scores_with_them_as_an_eval_run_does(alice, engine):
    from workers import evaluation

    expected_city = {"type": "text_similarity", "name": "close", "input": "{{sample.output_text}}",
                     "reference": "{{item.expected}}", "evaluation_metric": "fuzzy_match"}
    training = _named(jsonl([{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]} for i in range(10)]))
    file_id = alice.api.post("/v1/files", {"file": training, "purpose": "fine-tune"}, format="multipart").json()["id"]
    body = {"model": BASE, "training_file": file_id, "evaluation": {"file": file_id, "graders": [expected_city, {"type": "contains"}]}}
    created = alice.api.post("/v1/fine_tuning/jobs", body, format="json")
    assert created.status_code == 200, created.json()
    kept = created.json()["evaluation"]["graders"]
    assert kept[0]["evaluation_metric"] == "fuzzy_match" and kept[1] == {"type": "contains"}

    refused = alice.api.post("/v1/fine_tuning/jobs", body | {"evaluation": {"graders": [expected_city | {"evaluation_metric": "cosine"}]}},
                             format="json")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "evaluation.graders[0].evaluation_metric"

    examples = [[{"role": "user", "content": f"What is the capital of {c}?"}, {"role": "assistant", "content": f"{p}."}]
                for c, p in CAPITALS.items()]
    scores = evaluation.evaluate(alice.organization.pk, {"graders": kept, "threshold": 0.0}, examples, BASE, f"{BASE}:gated@r1")
    assert scores.adapter_score == pytest.approx(1.0) and scores.reference_score < 0.5 and scores.passed
