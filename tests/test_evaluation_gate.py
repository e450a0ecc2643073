"""The evaluation gate: its graders, and a job's evaluation checked at creation. (On the real
engine, a poisoned fine-tune blocked and a good one published: ``test_evaluation_gate_served``.)"""

import itertools
import json

import pytest

from core.evaluation import Case, Grader, cases_of, mean_score, passes
from finetuning.models import FineTuningJob
from tests.eval_fixtures import capitals
from tests.file_uploads import error_of

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
CATASTROPHIC = r"(a|a)+$"  # backtracks 2**n times on n a's and a mismatch, in re and in regex alike
MEMORY_BOMB = "(((a{100}){100}){100}){100}"  # regex.compile expands it: gigabytes (only ever in the child)


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
])
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
    per_case = [[float(passes(g, answer, case.expected)) for g in graders] for answer, case in zip(["It is Paris.", "Berlin."], cases)]
    assert mean_score(per_case) == pytest.approx((0.5 + 1.0) / 2)
    assert cases_of(examples, limit=1) == cases[:1]


def _create(persona, **body):
    from tests.file_uploads import upload

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
])
def test_a_malformed_evaluation_is_a_400_naming_it_and_nothing_is_queued(alice, evaluation, param):
    response = _create(alice, evaluation=evaluation)
    assert response.status_code in (400, 404), response.json()
    assert error_of(response)["param"].startswith(param), error_of(response)
    assert not FineTuningJob.objects.exists()


@pytest.mark.django_db
def test_an_evaluation_defaults_to_the_validation_file_and_shows_on_the_job(alice):
    from tests.file_uploads import upload

    validation = upload(alice, capitals()).json()["id"]
    response = _create(alice, validation_file=validation, evaluation={"graders": [{"type": "contains"}]})
    assert response.status_code == 200, response.json()
    assert response.json()["evaluation"] == {"file": validation, "graders": [{"type": "contains"}], "threshold": 0.0}


# --- the tenant's patterns and schemas are hostile until proven otherwise ---------------------------


@pytest.fixture
def listener():
    """A local HTTP server that records every request it gets: a grader must send it none."""
    import http.server
    import threading

    requests: list[str] = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            requests.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"type": "string"}')

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", requests
    server.shutdown()
    server.server_close()


def _evaluated(monkeypatch, graders: list[dict], answer: str, cases: int = 1):
    """``workers.evaluation.evaluate`` with the pool's answers canned (the engine's part is
    ``test_evaluation_gate_served``'s): the reference and the adapter both answer ``answer``."""
    from workers import evaluation

    canned_answers(monkeypatch, answer)
    examples = [json.loads(line)["messages"] for line in capitals().decode().splitlines()[:cases]]
    return evaluation.evaluate(0, {"graders": graders, "threshold": 0.0}, examples, BASE, f"{BASE}:x@r1")


def canned_answers(monkeypatch, answer: str) -> None:
    """Every model answers ``answer`` (``answering.batch.Answerer``: the backend's part is
    ``test_evals_runs`` with a stand-in engine, and ``test_evaluation_gate_served`` with the real one)."""
    from answering.batch import Answer, Answerer

    monkeypatch.setattr(Answerer, "answer", lambda self, target, prompts, sampling: [Answer(answer)] * len(prompts))


@pytest.mark.django_db
@pytest.mark.parametrize(("schema", "param"), [
    ({"$ref": "{remote}/x"}, "evaluation.graders[0].schema.$ref"),
    ({"type": "object", "properties": {"a": {"$ref": "{remote}/a#/b"}}}, "evaluation.graders[0].schema.properties.a.$ref"),
    ({"$id": "{remote}/base", "$ref": "other.json"}, "evaluation.graders[0].schema.$ref"),  # relative: remote too
    ({"$dynamicRef": "{remote}/x"}, "evaluation.graders[0].schema.$dynamicRef"),
    ({"allOf": [{"$ref": "file:///etc/passwd"}]}, "evaluation.graders[0].schema.allOf[0].$ref"),
])
def test_a_schema_pointing_outside_itself_is_refused_at_creation_and_nothing_is_fetched(alice, listener, schema, param):
    remote, requests = listener
    schema = json.loads(json.dumps(schema).replace("{remote}", remote))
    evaluation = {"graders": [{"type": "json_schema", "schema": schema}]}
    response = _create(alice, validation_file=_held_out(alice), evaluation=evaluation)
    assert response.status_code == 400, response.json()
    error = error_of(response)
    assert error["param"] == param and "points outside the schema" in error["message"], error
    assert requests == [] and not FineTuningJob.objects.exists()


def _held_out(persona) -> str:
    from tests.file_uploads import upload

    return upload(persona, capitals()).json()["id"]


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"items": schema}
    return schema


@pytest.mark.django_db
@pytest.mark.parametrize(("grader", "field", "says"), [
    ({"type": "regex", "pattern": "[z-a]"}, "pattern", "not a regular expression"),
    ({"type": "regex", "pattern": "a{1,99999999999}"}, "pattern", "not a regular expression"),  # re: OverflowError
    # Compiling this takes the regex package over 20 GB: checked in the grading process, within its limits.
    ({"type": "regex", "pattern": MEMORY_BOMB}, "pattern", "could not be compiled within 5 s and 1024 MB"),
    ({"type": "json_schema", "schema": _nested(40)}, "schema", "levels deep"),
    ({"type": "json_schema", "schema": {"enum": ["x" * 100] * 200}}, "schema", "bytes of JSON"),
    ({"type": "json_schema", "schema": {"type": "strin"}}, "schema", "not a JSON Schema"),
])
def test_a_grader_that_could_not_grade_is_a_400_naming_it_and_nothing_is_queued(alice, grader, field, says):
    response = _create(alice, validation_file=_held_out(alice), evaluation={"graders": [{"type": "contains"}, grader]})
    assert response.status_code == 400, response.json()
    error = error_of(response)
    assert error["param"] == f"evaluation.graders[1].{field}" and says in error["message"], error
    assert not FineTuningJob.objects.exists()


def test_a_stored_schema_pointing_outside_itself_fails_its_answers_and_fetches_nothing(monkeypatch, listener):
    """A job created before the check (or written by other means) still never makes a request."""
    remote, requests = listener
    schema = {"type": "object", "properties": {"city": {"$ref": f"{remote}/city"}}}
    graders = [{"type": "json_schema", "schema": schema}, {"type": "json_schema", "schema": {"$ref": f"{remote}/x"}}]
    scores = _evaluated(monkeypatch, graders, '{"city": "Paris"}')
    assert requests == []
    assert scores.reference_score == scores.adapter_score == 0.0


def test_a_catastrophic_regex_is_graded_in_bounded_time_while_the_heartbeat_keeps_beating(monkeypatch):
    """Python's re takes about 10 s for this answer here, holding the GIL: the heartbeat thread would
    be silent as long (and forever on a longer answer) and the job given up on."""
    import time

    from core import grading
    from finetuning import job_status
    from workers.heartbeat import Heartbeat

    monkeypatch.setattr(grading, "GRADE_TIMEOUT_S", 2.0)
    beats: list[float] = []
    monkeypatch.setattr(job_status, "heartbeat", lambda job_id, attempt, **fields: beats.append(time.monotonic()) or True)
    graders = [{"type": "regex", "pattern": CATASTROPHIC}, {"type": "contains"}]
    with Heartbeat("ftjob-graded", 1, interval_s=0.05):
        started = time.monotonic()
        scores = _evaluated(monkeypatch, graders, "a" * 25 + "!")  # two answers: the reference's and the adapter's
        took = time.monotonic() - started
    assert took < 2 * 2.0 + 2.0, f"grading took {took:.1f} s"
    assert scores.adapter_score == scores.reference_score == 0.0  # a timeout is a fail; "Paris." is not contained
    assert scores.timeouts == {f"regex grader {CATASTROPHIC!r}": 2}
    moments = [started, *beats, started + took]
    silent = max(later - earlier for earlier, later in itertools.pairwise(moments))
    assert silent < 1.0, f"the heartbeat was silent for {silent:.1f} s while grading"


def test_a_catastrophic_pattern_inside_a_schema_is_bounded_too(monkeypatch):
    """jsonschema's "pattern" keyword runs Python's re: only the separate process bounds it."""
    import time

    from core import grading

    monkeypatch.setattr(grading, "GRADE_TIMEOUT_S", 1.5)
    schema = {"type": "string", "pattern": f"^{CATASTROPHIC}"}
    started = time.monotonic()
    scores = _evaluated(monkeypatch, [{"type": "json_schema", "schema": schema}], json.dumps("a" * 25 + "!"), cases=2)
    took = time.monotonic() - started
    # 4 answers of about 10 s each in re: MAX_TIMEOUTS_PER_GRADER time out, the rest fail without running
    assert scores.adapter_score == 0.0 and scores.timeouts == {"json_schema grader": 4}
    assert took < grading.MAX_TIMEOUTS_PER_GRADER * 1.5 + 3.0, f"grading took {took:.1f} s"


def test_a_stored_pattern_too_large_to_compile_fails_its_answers_in_the_child(monkeypatch):
    scores = _evaluated(monkeypatch, [{"type": "regex", "pattern": MEMORY_BOMB}, {"type": "contains"}], "Paris.")
    assert scores.adapter_score == scores.reference_score == 0.5  # contains passes; the regex fails


def test_an_oversized_answer_fails_the_tenants_graders_unread():
    from core.evaluation import MAX_ANSWER_CHARS

    long_answer = "1889 " * (MAX_ANSWER_CHARS // 5 + 1)
    assert not passes(Grader("regex", pattern=r"\d{4}"), long_answer, "")
    assert not passes(Grader("json_schema", schema={"type": "string"}), json.dumps(long_answer), "")
    assert not passes(Grader("json_schema", schema={"type": "array"}), "[" * 50_000 + "]" * 50_000, "")


@pytest.mark.django_db
def test_a_grader_that_took_too_long_is_named_in_the_jobs_events(alice, monkeypatch):
    from core import grading
    from finetuning.models import JobStatus
    from workers import run_job
    from workers.heartbeat import Heartbeat

    monkeypatch.setattr(grading, "GRADE_TIMEOUT_S", 1.0)
    canned_answers(monkeypatch, "a" * 40 + "!")
    held_out = _held_out(alice)
    job = FineTuningJob.objects.create(
        organization=alice.organization, model=BASE, training_file=held_out, suffix="gated", seed=0, hyperparameters={},
        status=JobStatus.RUNNING, attempts=1,
        evaluation={"file": held_out, "graders": [{"type": "regex", "pattern": CATASTROPHIC}], "threshold": 0.0},
    )
    run_job._gate(job, Heartbeat(job.id, 1, 60), f"{BASE}:gated@r1")
    warnings = [event.message for event in job.events.filter(level="warn")]
    grader = f"regex grader {CATASTROPHIC!r}"
    assert warnings == [
        f"Evaluation: the {grader} was too slow (over 1 s an answer, and not run again after 3 such answers): "
        "24 answer(s) counted as fails"
    ]
    job.refresh_from_db()
    assert job.evaluation["scores"]["timeouts"] == {grader: 24}
