"""Evaluations through the official openai client (OpenAI's Evals API shape): an eval of a file and
its graders, runs for several models at once, scored by the run task with progress, per-item
results, cancel and failed answers. The serving backend is a stand-in (``tests.eval_fixtures``):
no engine starts here; the real engine's runs are ``engine`` tests."""

# ruff: noqa: F811 (pytest fixtures are imported from tests.eval_fixtures, then named as arguments)
from __future__ import annotations

import openai
import pytest

from core.api_errors import ApiError
from evals import run_status
from evals.models import Eval, EvalRun, OutputItem
from tests.eval_fixtures import BASE, REFUSED, capitals_file, engine, queued  # noqa: F401 (fixtures)
from tests.inference_fixtures import register_fine_tuned_model
from tests.personas import chat_example
from usage.models import CompletionUsage
from workers.run_eval import run_eval

pytestmark = pytest.mark.django_db(transaction=True)  # the live server reads the database in its own thread

EXACT = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}", "reference": "{{item.expected}}", "operation": "eq"}


def client_for(persona, live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=persona.key, max_retries=0)


def _eval(client: openai.OpenAI, data: bytes, criteria: list[dict]):
    uploaded = client.files.create(file=("held-out.jsonl", data), purpose="fine-tune")
    return client.evals.create(
        name="capitals", data_source_config={"type": "custom", "item_schema": {"type": "object"}},
        testing_criteria=criteria, extra_body={"file": uploaded.id},
    )


def test_the_openai_client_compares_models_on_one_eval_and_reads_each_items_verdicts(alice, live_server, engine, queued):
    client = client_for(alice, live_server)
    fine_tune = register_fine_tuned_model(alice, "capitals")
    evaluation = _eval(client, capitals_file(), [EXACT, {"type": "contains"}])
    assert evaluation.object == "eval" and [c.name for c in evaluation.testing_criteria] == ["exact", "contains"]
    assert client.evals.retrieve(evaluation.id).to_dict()["file"] == evaluation.to_dict()["file"]

    mix = {"model": BASE, "adapters": [{"model": fine_tune, "scale": 1.0}]}
    first = client.evals.runs.create(
        evaluation.id, data_source={"type": "completions", "model": BASE, "sampling_params": {"max_completion_tokens": 16}},
        extra_body={"models": [fine_tune, mix]},
    )
    runs = first.to_dict()["runs"]
    assert first.status == "queued" and first.model == BASE and [run["model"] for run in runs] == [BASE, fine_tune, BASE]
    assert runs[2]["adapters"] == [{"model": fine_tune, "scale": 1.0}] and queued == [run["id"] for run in runs]

    assert [run_eval(run_id, "test-worker") for run_id in queued] == ["completed"] * 3
    base, tuned, mixed = (client.evals.runs.retrieve(run_id, eval_id=evaluation.id) for run_id in queued)
    assert base.status == tuned.status == mixed.status == "completed"
    assert base.result_counts.to_dict() == {"total": 10, "passed": 0, "failed": 10, "errored": 0}
    assert tuned.result_counts.passed == mixed.result_counts.passed == 10
    assert {r.testing_criteria: (r.passed, r.failed) for r in tuned.per_testing_criteria_results} == {
        "exact": (10, 0), "contains": (10, 0)
    }
    assert tuned.to_dict()["progress"] == {"done": 10, "total": 10} and tuned.to_dict()["score"] == 1.0
    assert tuned.per_model_usage[0].invocation_count == 10 and tuned.per_model_usage[0].completion_tokens == 30

    items = client.evals.runs.output_items.list(tuned.id, eval_id=evaluation.id, limit=100).data
    assert len(items) == 10 and {item.status for item in items} == {"pass"}
    item = next(item for item in items if item.datasource_item_id == 0)
    assert item.datasource_item == {"input": [{"role": "user", "content": "What is the capital of France?"}], "expected": "Paris."}
    assert item.sample.output[0].content == "Paris." and item.sample.model == f"{fine_tune}@r1"
    assert [(result.name, result.passed) for result in item.results] == [("exact", True), ("contains", True)]
    assert [run.id for run in client.evals.runs.list(evaluation.id, limit=10).data] == list(reversed(queued))

    # Through the same path as any completion: each run's model, the organization's salt and fair-use
    # header, greedy sampling as asked; and counted in the organization's usage.
    assert {body["model"] for body in engine.bodies} == {BASE, fine_tune}
    assert all(body["cache_salt"] and body["temperature"] == 0 and body["max_completion_tokens"] == 16 for body in engine.bodies)
    assert set(engine.organizations) == {str(alice.organization.pk)}
    counted: dict[str, int] = {}
    for row in CompletionUsage.objects.filter(organization=alice.organization):  # a row a minute
        counted[row.model] = counted.get(row.model, 0) + row.requests
    assert counted == {BASE: 20, fine_tune: 10}


def test_a_run_canceled_midway_stops_at_its_next_batch_and_keeps_what_it_scored(alice, live_server, engine, queued, monkeypatch):
    client = client_for(alice, live_server)
    evaluation = _eval(client, capitals_file(rounds=3), [{"type": "contains"}])
    run = client.evals.runs.create(evaluation.id, data_source={"type": "completions", "model": BASE})
    recorded = run_status.record

    def record_then_cancel(run_id, items, totals):
        kept = recorded(run_id, items, totals)
        client.evals.runs.cancel(run.id, eval_id=evaluation.id)  # while the worker scores the next batch
        return kept

    monkeypatch.setattr(run_status, "record", record_then_cancel)
    assert run_eval(run.id, "test-worker") == "canceled"
    canceled = client.evals.runs.retrieve(run.id, eval_id=evaluation.id)
    assert canceled.status == "canceled" and canceled.to_dict()["progress"] == {"done": 8, "total": 15}
    assert OutputItem.objects.filter(run_id=run.id).count() == 8
    assert len(engine.bodies) == 15  # the second batch (7) was asked before the cancel was seen, and not kept


def test_a_queued_run_canceled_is_never_scored(alice, live_server, engine, queued):
    client = client_for(alice, live_server)
    evaluation = _eval(client, capitals_file(), [{"type": "contains"}])
    run = client.evals.runs.create(evaluation.id, data_source={"type": "completions", "model": BASE})
    assert client.evals.runs.cancel(run.id, eval_id=evaluation.id).status == "canceled"
    assert run_eval(run.id, "test-worker").startswith("nothing claimed") and engine.bodies == []


def test_an_answer_the_engine_refuses_is_an_errored_item_and_the_run_goes_on(alice, live_server, engine, queued):
    client = client_for(alice, live_server)
    evaluation = _eval(client, capitals_file(chat_example(REFUSED, "No.")), [{"type": "contains"}])
    fine_tune = register_fine_tuned_model(alice, "x")
    run = client.evals.runs.create(evaluation.id, data_source={"type": "completions", "model": fine_tune})
    assert run_eval(run.id, "test-worker") == "completed"
    done = client.evals.runs.retrieve(run.id, eval_id=evaluation.id)
    assert done.result_counts.to_dict() == {"total": 11, "passed": 10, "failed": 0, "errored": 1}
    [errored] = client.evals.runs.output_items.list(run.id, eval_id=evaluation.id, status="error").data
    assert errored.sample.output == [] and errored.results == [] and errored.sample.error.code == "400"
    assert "maximum context length" in errored.sample.error.message


def test_a_model_deleted_before_its_run_starts_fails_the_run_naming_it(alice, live_server, engine, queued):
    from finetuning.models import FineTunedModel

    client = client_for(alice, live_server)
    fine_tune = register_fine_tuned_model(alice, "short-lived")
    evaluation = _eval(client, capitals_file(), [{"type": "contains"}])
    run = client.evals.runs.create(evaluation.id, data_source={"type": "completions", "model": fine_tune})
    FineTunedModel.objects.filter(name=fine_tune).delete()
    assert run_eval(run.id, "test-worker") == "failed"
    failed = client.evals.runs.retrieve(run.id, eval_id=evaluation.id)
    assert failed.status == "failed" and failed.error.code == "model_not_found" and fine_tune in failed.error.message
    assert engine.bodies == []


def test_another_organizations_eval_and_runs_answer_404(alice, charlie, live_server, engine, queued):
    evaluation = _eval(client_for(alice, live_server), capitals_file(), [{"type": "contains"}])
    outsider = client_for(charlie, live_server)
    with pytest.raises(openai.NotFoundError):
        outsider.evals.retrieve(evaluation.id)
    with pytest.raises(openai.NotFoundError):
        outsider.evals.runs.create(evaluation.id, data_source={"type": "completions", "model": BASE})
    assert outsider.evals.list().data == [] and queued == []


# --- refusals: a 4xx naming what to fix; nothing created, nothing queued ---------------------------


def _upload(persona, data: bytes = b"") -> str:
    from tests.file_uploads import upload

    return upload(persona, data or capitals_file()).json()["id"]


@pytest.mark.parametrize(("criteria", "param", "says"), [
    ([{"type": "bleu"}], "testing_criteria.0.type", "unknown grader"),
    ([{"type": "python", "name": "code", "source": "def grade(sample, item):\n    return 1"}], "testing_criteria.0.type",
     "not offered"),
    ([{"type": "contains"}, {"type": "regex", "pattern": "("}], "testing_criteria.1.pattern", "not a regular expression"),
    ([{"type": "regex", "pattern": "(((a{100}){100}){100}){100}"}], "testing_criteria.0.pattern", "could not be compiled"),
    ([{"type": "json_schema", "schema": {"type": 7}}], "testing_criteria.0.schema", "not a JSON Schema"),
    ([{"type": "json_schema", "schema": {"$ref": "http://127.0.0.1:9/x"}}], "testing_criteria.0.schema.$ref", "points outside"),
    ([EXACT | {"input": "{{user.name}}"}], "testing_criteria.0.input", "namespaces are item and sample"),
    ([EXACT | {"operation": "sounds_like"}], "testing_criteria.0.operation", ""),
    ([{"type": "contains"}, {"type": "contains"}], "testing_criteria.1.name", "another grader is named"),
    ([{"type": "contains", "weight": 2}], "testing_criteria.0.weight", "Extra inputs"),
    ([], "testing_criteria", "1 to 8"),
])
def test_an_eval_with_a_grader_that_could_not_grade_is_a_400_naming_it(alice, criteria, param, says):
    response = alice.api.post("/v1/evals", {"testing_criteria": criteria, "file": _upload(alice)}, format="json")
    assert response.status_code == 400, response.json()
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert not Eval.objects.exists()


def test_an_eval_of_a_file_that_is_not_the_callers_or_has_no_answers_is_refused(alice, charlie):
    not_answers = b"".join(b'{"messages": [{"role": "user", "content": "q%d"}, {"role": "assistant", "content": "a"}, '
                           b'{"role": "user", "content": "and?"}]}\n' % i for i in range(10))
    for persona, file_id, status in ((alice, _upload(charlie), 404), (alice, _upload(alice, not_answers), 400)):
        response = persona.api.post("/v1/evals", {"testing_criteria": [{"type": "contains"}], "file": file_id}, format="json")
        assert response.status_code == status and response.json()["error"]["param"] == "file", response.json()
    assert not Eval.objects.exists()


@pytest.mark.parametrize(("data_source", "extra", "status", "param"), [
    ({"type": "completions", "model": "{charlies}"}, {}, 404, "data_source.model"),
    ({"type": "completions", "model": f"{BASE}:nobody"}, {}, 404, "data_source.model"),
    ({"type": "completions", "model": "no/such-base"}, {}, 404, "data_source.model"),
    ({"type": "completions", "model": BASE}, {"models": [BASE, f"{BASE}:nobody"]}, 404, "models.1.model"),
    ({"type": "completions", "model": BASE, "adapters": [{"model": BASE}]}, {}, 400, "data_source.adapters"),
    ({"type": "completions", "model": "{ours}", "adapters": [{"model": "{ours}"}]}, {}, 400, "data_source.model"),
    ({"type": "completions"}, {}, 400, "data_source.model"),
    ({"type": "completions", "model": BASE}, {"models": [BASE] * 9}, 400, "models"),
    ({"type": "jsonl", "source": {"type": "file_id", "id": "x"}}, {}, 404, "data_source.source.id"),
    ({"type": "jsonl", "model": BASE}, {}, 400, "data_source.model"),
    ({"type": "completions", "model": BASE, "input_messages": {"type": "template", "template": []}}, {}, 400, "data_source.input_messages.template"),
    ({"type": "completions", "model": BASE, "input_messages": {"type": "item_reference", "item_reference": "input"}}, {}, 400,
     "data_source.input_messages.item_reference"),
    ({"type": "completions", "model": BASE, "sampling_params": {"max_completion_tokens": 10**6}}, {}, 400, "data_source.sampling_params.max_completion_tokens"),
    ({"type": "completions", "model": BASE, "sampling_params": {"temperature": "0"}}, {}, 400, "data_source.sampling_params.temperature"),
    ({"type": "completions", "model": BASE, "source": {"type": "file_id", "id": "{charlies_file}"}}, {}, 404, "data_source.source.id"),
])
def test_a_run_of_a_model_the_caller_may_not_use_or_malformed_is_refused_and_nothing_is_queued(
    alice, charlie, queued, data_source, extra, status, param
):
    import json

    names = {"{charlies}": register_fine_tuned_model(charlie, "theirs"), "{ours}": register_fine_tuned_model(alice, "ours"),
             "{charlies_file}": _upload(charlie)}
    evaluation = alice.api.post("/v1/evals", {"testing_criteria": [{"type": "contains"}], "file": _upload(alice)}, format="json")
    text = json.dumps({"data_source": data_source, **extra})
    for placeholder, value in names.items():
        text = text.replace(placeholder, value)
    response = alice.api.post(f"/v1/evals/{evaluation.json()['id']}/runs", json.loads(text), format="json")
    assert response.status_code == status, response.json()
    assert response.json()["error"]["param"] == param, response.json()
    assert not EvalRun.objects.exists() and queued == []


def test_a_runs_answering_checks_access_as_the_gateway_does(alice, charlie):
    """The check a run's worker repeats: the registry's, and the mix's rule (``answering.access``)."""
    from answering.access import usable_target
    from answering.batch import Target

    theirs = register_fine_tuned_model(charlie, "theirs")
    with pytest.raises(ApiError) as refused:
        usable_target(alice.organization, Target(BASE, ((theirs, 0.5),)), "models.0")
    assert refused.value.status == 404 and refused.value.param == "models.0.adapters"
    assert usable_target(charlie.organization, Target(BASE, ((theirs, 0.5),))).name == BASE


# --- the publish gate: one use of the same answering and grading --------------------------------


def test_the_gate_answers_through_a_ray_backed_models_backend_and_counts_its_usage(alice, engine, settings):
    """The gate used to call the embedded pool directly: a Ray-backed base model's gate failed, and
    its answers were not counted. Now they go where the model's catalog backend says."""
    import json
    from dataclasses import replace

    from core.catalog import Catalog
    from workers import evaluation

    settings.MODEL_CATALOG = Catalog((replace(settings.MODEL_CATALOG.require(BASE), backend="ray"),))
    settings.RAY_SERVE_URL, settings.INFERENCE_POOL_URL = engine.url, "http://127.0.0.1:9"  # nothing listens there
    examples = [json.loads(line)["messages"] for line in capitals_file().decode().splitlines()]
    scores = evaluation.evaluate(alice.organization.pk, {"graders": [{"type": "contains"}], "threshold": 0.0}, examples,
                                 BASE, f"{BASE}:gated@r1")
    assert (scores.reference_score, scores.adapter_score, scores.passed) == (0.0, 1.0, True)
    assert len(engine.bodies) == 20 and {body["_path"] for body in engine.bodies} == {"/v1/chat/completions"}
    counted = {row.model for row in CompletionUsage.objects.filter(organization=alice.organization)}
    assert counted == {BASE, f"{BASE}:gated@r1"}


def test_the_gate_is_unavailable_when_an_answer_does_not_come_back(alice, engine):
    import json

    from workers import evaluation

    examples = [json.loads(line)["messages"] for line in capitals_file(chat_example(REFUSED, "No.")).decode().splitlines()]
    with pytest.raises(evaluation.EvaluationUnavailable, match="maximum context length"):
        evaluation.evaluate(alice.organization.pk, {"graders": [{"type": "contains"}], "threshold": 0.0}, examples, BASE, BASE)
