"""The REST API and the inference endpoints fuzzed against their OpenAPI schema (schemathesis), in-process through Django.

Every operation of ``/api/schema`` gets a fixed number of generated requests, valid and invalid,
with alice's key, and some without a key or with a wrong one. Whatever comes in, the API must
never answer 5xx, must answer every error in OpenAI's shape, and must write nothing when it refuses.

Some generated JSON bodies also get a value no schema generator writes, in place of one of their
fields: ``NaN``, ``Infinity``, ``-Infinity`` (which Python's and pydantic's parsers take, JSON does
not), an integer of 5,000 digits or just past 64 bits, and ``1e308``/``1e400``. Those that are not
JSON numbers, or are too large for any field, must be refused (4xx) whatever the operation.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import pytest
import schemathesis
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test.client import ClientHandler
from hypothesis import HealthCheck, given, settings as hypothesis_settings, strategies as st
from schemathesis import GenerationMode

from finetuning import files, job_creation
from finetuning.models import FineTuningJob, JobStatus
from finetuning.registry import list_usable_models
from finetuning.serializers import JobCreateSerializer
from tests.helpers import tenant_rows
from tests.personas import good_dataset

# Committed rows: the inference endpoints look the key up on threads of their own, with connections of their own.
pytestmark = pytest.mark.django_db(transaction=True)

EXAMPLES_PER_MODE = 20  # per operation, once valid (positive) and once invalid (negative) by the schema
MARK = "\x1f"  # where a hostile number goes in a generated body, before its JSON is written
# Raw JSON text, and whether any body holding it must be refused (the others are numbers a field may still take)
HOSTILE_NUMBERS = {
    "NaN": True, "Infinity": True, "-Infinity": True, "9" * 5000: True, str(2**63): True, "1e400": True,
    "1e308": False, "-1e308": False,
}
WRITES = {"POST", "PUT", "PATCH", "DELETE"}
ERROR_FIELDS = {"message", "type", "param", "code"}
WRONG_KEY = "sk-" + "x" * 43


def django_wsgi(environ: dict, start_response):
    """Django's test-client handler as a WSGI app: unlike ``WSGIHandler`` it does not close the
    database connection at the end of a request, which would end the test's transaction."""
    response = ClientHandler(enforce_csrf_checks=False)(environ)
    cookies = [("Set-Cookie", morsel.OutputString()) for morsel in response.cookies.values()]
    start_response(f"{response.status_code} {response.reason_phrase}", [*response.items(), *cookies])
    return [b"".join(response)] if response.streaming else [response.content]


@dataclass
class Findings:
    calls: Counter = field(default_factory=Counter)  # by status
    credentials: Counter = field(default_factory=Counter)
    hostile: Counter = field(default_factory=Counter)  # bodies sent with a hostile number, by its status
    by_operation: defaultdict = field(default_factory=lambda: defaultdict(Counter))
    problems: list[str] = field(default_factory=list)

    def note(self, case, credential: str, status: int, problem: str) -> None:
        body = case.body if not isinstance(case.body, dict | list) else json.dumps(case.body, default=repr)[:200]
        self.problems.append(
            f"{case.method} {case.formatted_path} query={case.query} body={body!r} [{credential}] -> {status}: {problem}"
        )


def _error_shape_problem(response) -> str | None:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI-shaped error: {response.text[:200]!r}"
    if not isinstance(error, dict) or not ERROR_FIELDS <= error.keys():
        return f"error without {sorted(ERROR_FIELDS)}: {error!r}"
    return None


def _pool_unreachable(case, response) -> bool:
    """The one 5xx a completion (or a Responses request) may get here: the test runs no inference pool."""
    answered = case.path.endswith("completions") or case.path == "/v1/responses"
    return answered and response.status_code == 503 and "pool_unavailable" in response.text


def _with_hostile_number(body, hostile: str | None, spot: int) -> tuple[str, bytes] | None:
    """A generated JSON object's text with ``hostile`` (raw JSON) as the value of one of its fields
    (``spot`` picks which; a new field ``n`` in an empty object), or None to send the body as generated."""
    if hostile is None or not isinstance(body, dict):
        return None
    keys = list(body) or ["n"]
    text = json.dumps(body | {keys[spot % len(keys)]: MARK}, default=repr).replace(json.dumps(MARK), hostile)
    return hostile, text.encode()


def _check(case, credential: str, headers: dict, findings: Findings, hostile: tuple[str, bytes] | None = None) -> None:
    before = tenant_rows() if case.method.upper() in WRITES else None
    response = case.call(data=hostile[1]) if hostile else case.call()  # a raw body replaces the generated one
    status = response.status_code
    if hostile:
        findings.hostile[status] += 1
    if hostile and HOSTILE_NUMBERS[hostile[0]] and not 400 <= status < 500:
        findings.note(case, credential, status, f"a body holding {hostile[0][:12]} was not refused: {response.text[:200]}")
    findings.calls[status] += 1
    findings.credentials[credential] += 1
    findings.by_operation[f"{case.method} {case.path}"][status] += 1
    if status >= 500 and not _pool_unreachable(case, response):
        findings.note(case, credential, status, response.text[:300])
    if status >= 400 and (problem := _error_shape_problem(response)):
        findings.note(case, credential, status, problem)
    if credential != "alice" and status < 400:
        findings.note(case, credential, status, "answered without a valid key")
    if before is not None and 400 <= status < 500 and tenant_rows() != before:
        findings.note(case, credential, status, f"refused, yet rows changed ({before} -> {tenant_rows()})")
    if case.method.upper() == "POST" and case.path == "/v1/fine_tuning/jobs" and status == 200:
        # Inert from now on: the session's worker would train it (the sweeper resends a queued job
        # after a minute), and its checkpoints and model would land in some later request's count.
        FineTuningJob.objects.filter(pk=response.json()["id"]).update(status=JobStatus.CANCELLED)


@pytest.fixture
def objects(alice, charlie) -> dict[str, str]:
    """Real ids for the path parameters, so that requests get past "no such file" too; charlie's
    must stay invisible to alice (404)."""
    upload = _named(good_dataset(12))
    alice_file = files.upload_file(alice.organization, alice.user, upload, files.PURPOSE)
    request = JobCreateSerializer(data={"model": list_usable_models(alice.organization)[0].name, "training_file": alice_file.id})
    request.is_valid(raise_exception=True)
    alice_job = job_creation.create_job(alice.organization, alice.user, request.to_job_request())
    charlie_file = files.upload_file(charlie.organization, charlie.user, _named(good_dataset(12)), files.PURPOSE)
    return {"alice_file": alice_file.id, "alice_job": alice_job.id, "charlie_file": charlie_file.id}


def _named(data: bytes) -> SimpleUploadedFile:
    return SimpleUploadedFile("train.jsonl", data, content_type="application/jsonl")


def test_no_generated_request_gets_a_5xx_an_unshaped_error_or_a_write_on_refusal(alice, objects, settings, not_queued):
    settings.INFERENCE_POOL_URL = "http://127.0.0.1:9"  # nothing listens: a completion that passes every check is a 503
    model_names = st.sampled_from([None, *(model.name for model in list_usable_models(alice.organization))])
    schema = schemathesis.openapi.from_wsgi("/api/schema", django_wsgi, headers={"Accept": "application/json"})
    findings, operations = Findings(), 0
    real_ids = st.sampled_from([None, *objects.values()])  # None: keep the generated id
    credentials = st.sampled_from(["alice"] * 6 + ["no key", "wrong key"])
    hostile_numbers = st.one_of(st.none(), st.sampled_from(list(HOSTILE_NUMBERS)))  # None: the body as generated
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @hypothesis_settings(
                max_examples=EXAMPLES_PER_MODE, derandomize=True, database=None, deadline=None,
                suppress_health_check=list(HealthCheck), phases=["explicit", "generate"],
            )
            @given(
                case=operation.as_strategy(generation_mode=mode), real_id=real_ids, real_model=model_names,
                credential=credentials, hostile=hostile_numbers, spot=st.integers(0, 63),
            )
            def fuzz(case, real_id, real_model, credential, hostile, spot):
                if real_id is not None and "id" in (case.path_parameters or {}):
                    case.path_parameters["id"] = real_id
                if real_model is not None and isinstance(case.body, dict) and "model" in case.body:
                    case.body["model"] = real_model  # so that some requests get past "no such model"
                headers = {"Authorization": f"Bearer {alice.key}"} if credential == "alice" else {}
                if credential == "wrong key":
                    headers["Authorization"] = f"Bearer {WRONG_KEY}"
                # On the case itself: schemathesis drops call(headers=...)'s Authorization for cases it
                # generated to test a missing one.
                case.headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"} | headers
                _check(case, credential, headers, findings, _with_hostile_number(case.body, hostile, spot))

            fuzz()
    cases = sum(findings.calls.values())
    for name, statuses in sorted(findings.by_operation.items()):
        print(f"  {name}: {dict(sorted(statuses.items()))}")
    print(f"\nfuzzed {operations} operations with {cases} requests: {dict(sorted(findings.calls.items()))} {dict(findings.credentials)}")
    print(f"of them with a hostile number in the body: {dict(sorted(findings.hostile.items()))}")
    assert operations >= 16 and cases >= operations * EXAMPLES_PER_MODE
    assert not findings.problems, "\n".join(findings.problems[:40])
