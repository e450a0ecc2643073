"""The hostile corpus: every door of the platform that takes input, crossed with every kind of bad input.

A door is an endpoint under /v1/ or a dashboard form or page, with what it reads: a JSON body, a
form, a multipart form (only its plain fields here: archives have a corpus of their own), a query
string, or nothing. A hostile class is one way to be wrong: non-standard JSON (``NaN``,
``Infinity``, ``-Infinity``), an integer of thousands of digits or just past 64 bits, a float at
the edge of the range (``1e308``) or past it (``1e400``), a wrong type, 100,000 levels of ``[``, an
empty body, a body over the size limit, a ``Content-Length`` of 5,000 digits, an unknown field, a
NUL character, a lone UTF-16 surrogate (JSON only). ``HOSTILE`` lists them, ``DOORS`` the doors.

Each cell (a door and a class that applies to it) must answer a 4xx that says what is wrong (the
field, or the problem), write no row, and never a 5xx. A dashboard form may instead show itself
again with the error next to the field (200) or go back with an error message (302), as its pages
do for any refusal. ``test_every_route_has_a_door_or_a_reason_to_have_none`` compares the table with the URL configuration,
so a new endpoint without a row fails.

In-process through Django's test client (the completion endpoints parse the body before they need
the inference pool, which is not running), and through the ASGI application as ``server/asgi.py``
builds it for the body-size cap, which stands in front of Django.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from urllib.parse import quote, unquote_to_bytes

import httpx
import pytest
from django.contrib.messages import get_messages
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from django.utils import timezone

from batches.models import Batch
from evals.models import Eval, EvalRun
from finetuning import files, job_creation
from finetuning.models import FineTuningJob, JobStatus
from tests.helpers import tenant_rows
from tests.inference_fixtures import BASE, register_fine_tuned_model
from training_loops.models import CheckpointKind, LoopCheckpoint, LoopRun, LoopSession, RunStatus
from tests.personas import Persona, batch_lines, good_dataset, preference_dataset, prompts_dataset
from webhooks import endpoints

# Committed rows: the gateway looks keys up on threads of its own, with connections of their own.
pytestmark = pytest.mark.django_db(transaction=True)

JSON, FORM, MULTIPART, QUERY, NOTHING = "json", "form", "multipart", "query", "nothing"
MARK = "\x1f"  # where a hostile value goes in a door's valid request, before it is encoded
HUGE_DIGITS = "9" * 5000
PAST_64_BITS = str(2**63)  # one more than a signed 64-bit integer holds
DEEP = "[" * 100_000
SIZE_CLASSES = ("huge body", "5,000-digit Content-Length")  # sent through the ASGI application, not the test client


@dataclass(frozen=True)
class Door:
    """One way in, with a request it would accept (``valid``), and which of its fields is a number and
    which a string. Paths name alice's objects as ``{file}``, ``{job}``, ``{model}``, ``{key}``."""

    method: str
    path: str
    route: str  # its name in the URL configuration (dashboard: namespaced)
    reads: str  # JSON, FORM, MULTIPART, QUERY or NOTHING
    valid: dict = field(default_factory=dict)
    number: str | None = None  # a field (or query parameter) that takes a number; in a JSON body, a dotted path
    text: str | None = None  # a field that takes a string
    session: bool = False  # the dashboard's signed-in session, not an API key
    # A dashboard page that shows its nearest usable page (or its default) for an unusable query value,
    # as it always has: a 200 is the right answer there, a 5xx still is not.
    lenient_query: bool = False
    # The Tinker protocol: its SDK sends fields newer than a server knows, which the server ignores (as
    # Tinker's own do), so an unknown field is no refusal there.
    ignores_unknown_fields: bool = False

    @property
    def api(self) -> bool:
        return self.path.startswith(("/v1/", "/api/v1/")) or self.path == "/playground/chat"


CHAT = {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
RESPONSES = {"model": BASE, "input": "hi", "max_output_tokens": 8}
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CHAT_TOOLS = CHAT | {"tools": [{"type": "function", "function": WEATHER}], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
RESPONSES_TOOLS = RESPONSES | {"tools": [{"type": "function", **WEATHER}], "tool_choice": {"type": "function", "name": "get_weather"}}
JOB = {"model": BASE, "training_file": "{file}", "seed": 1, "suffix": "hostile"}
# Early stopping watches a validation file's loss: a request without one is refused for that.
EARLY_STOPPING = JOB | {"validation_file": "{file}", "hyperparameters": {"early_stopping": {"patience": 2}}}
METHOD = JOB | {"method": {"type": "supervised", "supervised": {"hyperparameters": {}}}}
DPO = JOB | {"training_file": "{pairs}", "method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.1, "n_epochs": 1}}}}
REINFORCE = JOB | {"training_file": "{prompts}", "method": {"type": "reinforcement", "reinforcement": {
    "grader": {"type": "text_similarity", "name": "close", "input": "{{sample.output_text}}", "reference": "{{item.reference_answer}}",
               "evaluation_metric": "fuzzy_match"},
    "hyperparameters": {"n_epochs": 1, "compute_multiplier": 2, "max_completion_tokens": 16}}}}
COMPOSE = {"parents": [{"model": "{model}", "scale": 0.5}], "suffix": "hostile-mix", "method": "svd", "rank": 4}
JOB_FORM = {
    "model": BASE, "training_file": "{file}", "suffix": "hostile", "n_epochs": "1", "lora_r": "8", "lora_alpha": "16",
    "lora_dropout": "0.05", "target_modules": "q_proj",
}
REINFORCE_FORM = JOB_FORM | {"training_file": "{prompts}", "method": "reinforcement", "grader": json.dumps(
    REINFORCE["method"]["reinforcement"]["grader"]).replace("{", "{{").replace("}", "}}")}
COMPOSE_FORM = {
    "compose-parents": "{model}",
    "compose-method": "svd",
    "compose-rank": "4",
    "compose-suffix": "hostile-mix",
}
PAGE = {"page": "1"}
EVAL = {"testing_criteria": [{"type": "contains"}], "file": "{file}", "name": "hostile eval"}
WEBHOOK = {"url": "https://example.com/hook", "description": "hostile"}
BATCH = {"input_file_id": "{batchfile}", "endpoint": "/v1/chat/completions", "completion_window": "24h"}
RUN = {"data_source": {"type": "completions", "model": BASE, "sampling_params": {"max_completion_tokens": 8, "temperature": 0}}}
# OpenAI's evals guide's shapes: a custom item schema, graders on item fields, items inline, a template.
SIMILARITY = {"type": "text_similarity", "name": "close", "input": "{{sample.output_text}}", "reference": "{{item.answer}}",
              "evaluation_metric": "bleu", "pass_threshold": 0.5}
JUDGE = {"type": "score_model", "name": "judge", "model": BASE, "range": [0, 10], "sampling_params": {"temperature": 0},
         "input": [{"role": "user", "content": "Score {{sample.output_text}}"}]}
GUIDE_EVAL = {"data_source_config": {"type": "custom", "item_schema": {"type": "object", "properties": {"answer": {"type": "string"}}}},
              "testing_criteria": [SIMILARITY]}
# Items as the door's eval (a chat file's) describes them: input and expected.
GUIDE_RUN = {"data_source": {"type": "completions", "model": BASE,
                             "source": {"type": "file_content", "content": [{"item": {"input": [], "expected": "Paris"}}]},
                             "input_messages": {"type": "template", "template": [{"role": "user", "content": "{{item.expected}}?"}]}}}
CLOSE = {key: value for key, value in SIMILARITY.items() if key != "pass_threshold"}  # graders.run's: no threshold
GRADER_RUN = {"grader": JUDGE, "model_sample": "Paris", "item": {"answer": "Paris"}}
# The Tinker SDK's requests (tinker/types), as it sends them.
TINKER_RUN = {"session_id": "{session}", "base_model": BASE, "lora_config": {"rank": 8}, "model_seq_id": 0}
TINKER_SAMPLE = {"num_samples": 1, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                 "sampling_params": {"max_tokens": 4, "temperature": 1.0}, "base_model": BASE}
STATE_PATH = "tinker://{looprun}/weights/hostile"


def tinker_door(path: str, route: str, valid: dict, number: str | None = None, text: str | None = None) -> Door:
    return Door("POST", f"/api/v1/{path}", route, JSON, valid, number, text, ignores_unknown_fields=True)

# The one table of doors. GET routes read a query string at most; those that read none are in EXCLUDED.
# fmt: off
DOORS = [
    # The API (an API key)
    Door("POST", "/v1/chat/completions", "chat-completions", JSON, CHAT, number="max_tokens", text="model"),
    Door("POST", "/v1/chat/completions", "chat-completions", JSON, CHAT_TOOLS, text="tools.0.function.name"),
    Door("POST", "/v1/chat/completions", "chat-completions", JSON, CHAT_TOOLS, text="tool_choice.function.name"),
    Door("POST", "/v1/completions", "completions", JSON, {"model": BASE, "prompt": "hi", "max_tokens": 8}, "max_tokens", "prompt"),
    Door("POST", "/v1/responses", "responses", JSON, RESPONSES, number="max_output_tokens", text="model"),
    Door("POST", "/v1/responses", "responses", JSON, RESPONSES | {"temperature": 0}, number="temperature", text="input"),
    Door("POST", "/v1/responses", "responses", JSON, RESPONSES | {"instructions": "be brief"}, text="instructions"),
    Door("POST", "/v1/responses", "responses", JSON, RESPONSES_TOOLS, text="tools.0.name"),
    Door("POST", "/v1/responses", "responses", JSON, RESPONSES_TOOLS, text="tool_choice.name"),
    Door("POST", "/v1/fine_tuning/jobs", "fine-tuning-job-list", JSON, JOB, number="seed", text="suffix"),
    # "model" names an adapter to train on from as well: a revision, a checkpoint, an uploaded model
    # (names shaped like those but hostile: tests/test_continued_training.py).
    Door("POST", "/v1/fine_tuning/jobs", "fine-tuning-job-list", JSON, JOB | {"model": "{model}@r1"}, text="model"),
    Door("POST", "/v1/fine_tuning/jobs", "fine-tuning-job-list", JSON, JOB, number="hyperparameters.n_checkpoints"),
    Door("POST", "/v1/fine_tuning/jobs", "fine-tuning-job-list", JSON, JOB, number="hyperparameters.n_evals"),
    Door("POST", "/v1/fine_tuning/jobs", "fine-tuning-job-list", JSON, EARLY_STOPPING, "hyperparameters.early_stopping.patience"),
    Door("POST", "/v1/fine_tuning/jobs", "fine-tuning-job-list", JSON, EARLY_STOPPING, "hyperparameters.early_stopping.min_delta"),
    Door("POST", "/v1/fine_tuning/jobs", "fine-tuning-job-list", JSON, METHOD, "method.supervised.hyperparameters.n_evals"),
    Door("POST", "/v1/fine_tuning/jobs", "fine-tuning-job-list", JSON, DPO, "method.dpo.hyperparameters.beta", "method.type"),
    Door("POST", "/v1/fine_tuning/jobs", "fine-tuning-job-list", JSON, DPO, "method.dpo.hyperparameters.n_epochs"),
    Door("POST", "/v1/fine_tuning/jobs", "fine-tuning-job-list", JSON, REINFORCE, "method.reinforcement.hyperparameters.compute_multiplier", "method.reinforcement.grader.reference"),
    Door("POST", "/v1/fine_tuning/jobs", "fine-tuning-job-list", JSON, REINFORCE, "method.reinforcement.hyperparameters.max_completion_tokens", "method.reinforcement.grader.evaluation_metric"),
    Door("POST", "/v1/fine_tuning/models", "fine-tuning-model-compose", JSON, COMPOSE, number="rank", text="suffix"),
    Door("POST", "/v1/fine_tuning/models/{model}/rollback", "fine-tuning-model-rollback", JSON, {"revision": 1}, "revision"),
    Door("POST", "/v1/evals", "eval-list", JSON, EVAL, text="name"),
    Door("POST", "/v1/evals", "eval-list", JSON, EVAL, text="file"),
    Door("POST", "/v1/evals/{eval}", "eval-detail", JSON, {"name": "renamed"}, text="name"),
    Door("POST", "/v1/evals/{eval}/runs", "eval-run-list", JSON, RUN, "data_source.sampling_params.max_completion_tokens", "data_source.model"),
    Door("POST", "/v1/evals/{eval}/runs", "eval-run-list", JSON, RUN, "data_source.sampling_params.temperature", "name"),
    Door("POST", "/v1/evals", "eval-list", JSON, GUIDE_EVAL, "testing_criteria.0.pass_threshold", "testing_criteria.0.reference"),
    Door("POST", "/v1/evals", "eval-list", JSON, GUIDE_EVAL | {"testing_criteria": [JUDGE | {"pass_threshold": 5}]},
         "testing_criteria.0.pass_threshold", "testing_criteria.0.model"),
    Door("POST", "/v1/evals/{eval}/runs", "eval-run-list", JSON, GUIDE_RUN, text="data_source.input_messages.template.0.content"),
    Door("POST", "/v1/evals/{eval}/runs", "eval-run-list", JSON, GUIDE_RUN, text="data_source.source.content.0.item.expected"),
    Door("POST", "/v1/fine_tuning/alpha/graders/validate", "graders-validate", JSON, {"grader": CLOSE}, text="grader.evaluation_metric"),
    Door("POST", "/v1/fine_tuning/alpha/graders/validate", "graders-validate", JSON, {"grader": JUDGE}, "grader.sampling_params.temperature", "grader.input.0.content"),
    Door("POST", "/v1/fine_tuning/alpha/graders/run", "graders-run", JSON, GRADER_RUN, "grader.range.1", "model_sample"),
    Door("POST", "/v1/evals/{eval}/runs/{run}/cancel", "eval-run-cancel", NOTHING),
    # The Tinker protocol (X-API-Key: tml-<key>)
    tinker_door("create_session", "tinker-create-session", {"tags": [], "sdk_version": "0.38.0"}, text="sdk_version"),
    tinker_door("create_session", "tinker-create-session", {"tags": ["a"], "user_metadata": {"k": "v"}}, text="tags.0"),
    tinker_door("session_heartbeat", "tinker-session-heartbeat", {"session_id": "{session}"}, text="session_id"),
    tinker_door("create_model", "tinker-create-model", TINKER_RUN, "lora_config.rank", "base_model"),
    tinker_door("create_model", "tinker-create-model", TINKER_RUN, "lora_config.seed", "session_id"),
    tinker_door("get_info", "tinker-get-info", {"model_id": "{looprun}"}, text="model_id"),
    tinker_door("optim_step", "tinker-optim-step", {"model_id": "{looprun}", "adam_params": {"learning_rate": 1e-4}},
                "adam_params.learning_rate", "model_id"),
    tinker_door("optim_step", "tinker-optim-step", {"model_id": "{looprun}", "adam_params": {"beta2": 0.95}}, "adam_params.beta2"),
    tinker_door("save_weights", "tinker-save-weights", {"model_id": "{looprun}", "path": "hostile"}, "seq_id", "path"),
    tinker_door("save_weights_for_sampler", "tinker-save-weights-for-sampler", {"model_id": "{looprun}", "path": "hostile"},
                "sampling_session_seq_id", "path"),
    tinker_door("load_weights", "tinker-load-weights", {"model_id": "{looprun}", "path": STATE_PATH, "optimizer": True}, text="path"),
    tinker_door("load_weights", "tinker-load-weights", {"session_id": "{session}", "path": STATE_PATH, "optimizer": True},
                text="session_id"),
    tinker_door("create_sampling_session", "tinker-create-sampling-session", {"session_id": "{session}", "base_model": BASE},
                text="base_model"),
    tinker_door("asample", "tinker-asample", TINKER_SAMPLE, "sampling_params.max_tokens", "base_model"),
    tinker_door("asample", "tinker-asample", TINKER_SAMPLE, "num_samples", "prompt.chunks.0.type"),
    tinker_door("asample", "tinker-asample", TINKER_SAMPLE, "sampling_params.temperature", "sampling_params.stop"),
    tinker_door("asample", "tinker-asample", TINKER_SAMPLE, "prompt.chunks.0.tokens.0"),
    Door("POST", "/api/v1/training_runs/{looprun}/checkpoints/sampler_weights/hostile/publish", "tinker-publish-checkpoint",
         JSON, {"suffix": "hostile-published"}, text="suffix"),
    tinker_door("retrieve_future", "tinker-retrieve-future", {"request_id": "req_0"}, text="request_id"),
    Door("GET", "/api/v1/training_runs", "tinker-training-runs", QUERY, {"limit": "5"}, number="limit"),
    Door("GET", "/api/v1/training_runs", "tinker-training-runs", QUERY, {"offset": "0"}, number="offset"),
    Door("DELETE", "/v1/evals/{eval}", "eval-detail", NOTHING),
    Door("DELETE", "/v1/evals/{eval}/runs/{run}", "eval-run-detail", NOTHING),
    Door("GET", "/v1/evals", "eval-list", QUERY, {"limit": "2"}, "limit", "after"),
    Door("GET", "/v1/evals/{eval}/runs", "eval-run-list", QUERY, {"limit": "2", "status": "completed"}, "limit", "status"),
    Door("GET", "/v1/evals/{eval}/runs", "eval-run-list", QUERY, {"limit": "2"}, text="after"),
    Door("GET", "/v1/evals/{eval}/runs/{run}/output_items", "eval-run-output-items", QUERY, {"limit": "2"}, "limit", "status"),
    Door("POST", "/v1/batches", "batch-list", JSON, BATCH, text="input_file_id"),
    Door("POST", "/v1/batches", "batch-list", JSON, BATCH, text="completion_window"),
    Door("POST", "/v1/batches", "batch-list", JSON, BATCH | {"metadata": {"k": "v"}}, text="metadata.k"),
    Door("POST", "/v1/batches/{batch}/cancel", "batch-cancel", NOTHING),
    Door("GET", "/v1/batches", "batch-list", QUERY, {"limit": "2"}, "limit", "after"),
    Door("POST", "/v1/webhooks", "webhook-list", JSON, WEBHOOK, text="url"),
    Door("POST", "/v1/webhooks", "webhook-list", JSON, WEBHOOK, text="description"),
    Door("POST", "/v1/webhooks", "webhook-list", JSON, WEBHOOK | {"event_types": ["model.ready"]}, text="event_types"),
    Door("POST", "/v1/webhooks/{webhook}", "webhook-detail", JSON, {"enabled": True, "url": "https://example.com/x"}, "enabled", "url"),
    Door("DELETE", "/v1/webhooks/{webhook}", "webhook-detail", NOTHING),
    Door("GET", "/v1/webhooks", "webhook-list", QUERY, {"limit": "2"}, "limit", "after"),
    Door("GET", "/v1/webhooks/{webhook}/deliveries", "webhook-deliveries", QUERY, {"limit": "2"}, "limit", "after"),
    Door("POST", "/v1/files", "file-list", MULTIPART, {"purpose": "fine-tune"}, text="purpose"),
    Door("POST", "/v1/fine_tuning/adapters", "fine-tuning-adapter-upload", MULTIPART, {"model": BASE, "suffix": "up"}, text="model"),
    Door("POST", "/v1/fine_tuning/jobs/{job}/cancel", "fine-tuning-job-cancel", NOTHING),
    Door("DELETE", "/v1/files/{file}", "file-detail", NOTHING),
    Door("DELETE", "/v1/models/{model}", "model", NOTHING),
    Door("GET", "/v1/files", "file-list", QUERY, {"limit": "2", "purpose": "fine-tune"}, "limit", "after"),
    Door("GET", "/v1/fine_tuning/jobs", "fine-tuning-job-list", QUERY, {"limit": "2"}, "limit", "after"),
    Door("GET", "/v1/fine_tuning/jobs/{job}/events", "fine-tuning-job-events", QUERY, {"limit": "2"}, "limit", "after"),
    Door("GET", "/v1/fine_tuning/jobs/{job}/checkpoints", "fine-tuning-job-checkpoints", QUERY, {"limit": "2"}, "limit", "after"),
    Door("GET", "/v1/fine_tuning/compositions", "fine-tuning-composition-list", QUERY, {"limit": "2"}, "limit", "after"),
    Door("GET", "/v1/organization/usage/completions", "usage-completions", QUERY, {"start_time": "0"}, "start_time"),  # models= filters: any name
    Door("GET", "/v1/organization/usage/completions", "usage-completions", QUERY, {"start_time": "0"}, "end_time", "group_by"),
    Door("GET", "/v1/organization/usage/completions", "usage-completions", QUERY, {"start_time": "0"}, "limit", "bucket_width"),
    Door("GET", "/v1/organization/usage/completions", "usage-completions", QUERY, {"start_time": "0"}, "page"),
    Door("GET", "/v1/organization/usage/fine_tuning", "usage-fine-tuning", QUERY, {"start_time": "0"}, "start_time", "group_by"),
    # The dashboard (alice's signed-in session; forms are sent as a browser sends them)
    Door("POST", "/playground/chat", "dashboard:playground_chat", JSON, CHAT, "max_tokens", "model", session=True),
    Door("POST", "/login", "dashboard:login", FORM, {"username": "alice", "password": "wrong"}, text="username"),
    Door("POST", "/logout", "dashboard:logout", NOTHING, session=True),
    Door("POST", "/organization", "dashboard:switch", FORM, {"organization": "{org}"}, "organization", session=True),
    Door("POST", "/datasets", "dashboard:datasets", MULTIPART, session=True),
    Door("POST", "/datasets/{file}/delete", "dashboard:dataset_delete", NOTHING, session=True),
    Door("POST", "/jobs/new", "dashboard:job_new", FORM, JOB_FORM, "n_epochs", "suffix", session=True),
    Door("POST", "/jobs/new", "dashboard:job_new", FORM, JOB_FORM, "learning_rate_multiplier", session=True),
    Door("POST", "/jobs/new", "dashboard:job_new", FORM, JOB_FORM, "early_stopping_patience", "n_checkpoints", session=True),
    Door("POST", "/jobs/new", "dashboard:job_new", FORM, JOB_FORM, "early_stopping_min_delta", "n_evals", session=True),
    Door("POST", "/jobs/new", "dashboard:job_new", FORM, JOB_FORM, "beta", "method", session=True),
    Door("POST", "/jobs/new", "dashboard:job_new", FORM, REINFORCE_FORM, "batch_size", "grader", session=True),
    Door("POST", "/jobs/{job}/cancel", "dashboard:job_cancel", NOTHING, session=True),
    Door("POST", "/models/upload", "dashboard:adapter_upload", MULTIPART, {"adapter-model": BASE}, text="adapter-suffix", session=True),
    Door("POST", "/models/compose", "dashboard:model_compose", FORM, COMPOSE_FORM, "compose-rank", "compose-suffix", session=True),
    Door("POST", "/models/compose", "dashboard:model_compose", FORM, COMPOSE_FORM, "compose-density", session=True),
    Door("POST", "/models/{model}/delete", "dashboard:model_delete", NOTHING, session=True),
    Door("POST", "/models/{model}/rollback", "dashboard:model_rollback", FORM, {"revision": "1"}, "revision", session=True),
    # The models page's Compare buttons: the eval to run the model (and its base, or its revisions) on.
    Door("POST", "/models/{model}/compare/base", "dashboard:model_compare_base", FORM, {"eval": "{eval}"}, text="eval", session=True),
    Door("POST", "/models/{model}/compare/revisions", "dashboard:model_compare_revisions", FORM, {"eval": "{eval}"}, text="eval", session=True),
    Door("POST", "/evals/{eval}/runs/{run}/cancel", "dashboard:eval_run_cancel", NOTHING, session=True),
    Door("POST", "/keys", "dashboard:api_keys", FORM, {"name": "hostile"}, text="name", session=True),
    Door("POST", "/keys/{key}/revoke", "dashboard:api_key_revoke", NOTHING, session=True),
    # A check box: any body is an answer (one without "allowed=on" is the box left unticked).
    Door("POST", "/organization/members", "dashboard:members_may_manage", NOTHING, session=True),
    Door("POST", "/webhooks", "dashboard:webhooks", FORM, {"url": "https://example.com/hook"}, text="url", session=True),
    Door("POST", "/webhooks", "dashboard:webhooks", FORM, {"url": "https://example.com/hook", "description": "d"}, text="description", session=True),
    Door("POST", "/webhooks/{webhook}/delete", "dashboard:webhook_delete", NOTHING, session=True),
    # A check box: any body is an answer (one without "enabled=on" is the box left unticked).
    Door("POST", "/webhooks/{webhook}/enabled", "dashboard:webhook_enabled", NOTHING, session=True),
    Door("GET", "/webhooks", "dashboard:webhooks", QUERY, PAGE, "page", session=True, lenient_query=True),
    Door("GET", "/webhooks/{webhook}", "dashboard:webhook", QUERY, PAGE, "page", session=True, lenient_query=True),
    Door("GET", "/datasets", "dashboard:datasets", QUERY, PAGE, "page", session=True, lenient_query=True),
    Door("GET", "/jobs", "dashboard:jobs", QUERY, PAGE, "page", session=True, lenient_query=True),
    Door("GET", "/evals", "dashboard:evals", QUERY, PAGE, "page", session=True, lenient_query=True),
    Door("GET", "/batches", "dashboard:batches", QUERY, PAGE, "page", session=True, lenient_query=True),
    Door("GET", "/evals/{eval}", "dashboard:eval", QUERY, PAGE, "page", session=True, lenient_query=True),
    Door("GET", "/jobs/{job}/progress", "dashboard:job_progress", QUERY, {"metrics_from": "0"}, "metrics_from", session=True),
    Door("GET", "/usage", "dashboard:usage", QUERY, {"days": "7"}, "days", session=True, lenient_query=True),
    Door("GET", "/playground", "dashboard:playground", QUERY, {"model": BASE}, text="model", session=True, lenient_query=True),
]
# fmt: on

# Routes (and methods) that read nothing a tenant chooses beyond the ids in their path (covered by
# test_access_matrix and the schema fuzzer), each with why.
EXCLUDED = {
    ("file-detail", "GET"): "a file by its id",
    ("file-content", "GET"): "a file's bytes by its id",
    ("fine-tuning-job-detail", "GET"): "a job by its id",
    ("fine-tuning-composition-detail", "GET"): "a composition by its id",
    ("fine-tuning-job-checkpoint-adapter", "GET"): "a checkpoint's archive by its ids",
    ("fine-tuning-model-adapter", "GET"): "a model's archive by its name",
    ("fine-tuning-model-revisions", "GET"): "a model's revisions by its name",
    ("models", "GET"): "the list of models: no parameters",
    ("eval-detail", "GET"): "an eval by its id",
    ("eval-run-detail", "GET"): "an eval run by its ids",
    ("eval-run-output-item", "GET"): "an output item by its ids",
    ("webhook-detail", "GET"): "a webhook endpoint by its id",
    ("batch-detail", "GET"): "a batch by its id",
    ("dashboard:batch_file", "GET"): "a batch's input, output or error file by its ids",
    ("model", "GET"): "a model by its name",
    ("response", "*"): "a response by its id: none is stored, so any id is the same 404",
    ("dashboard:home", "GET"): "a redirect",
    ("dashboard:login", "GET"): "the sign-in page",
    ("dashboard:dataset", "GET"): "a dataset by its id",
    ("dashboard:job", "GET"): "a job by its id",
    ("dashboard:job_new", "GET"): "the empty form",
    ("dashboard:checkpoint_adapter", "GET"): "a checkpoint's archive by its ids",
    ("dashboard:models", "GET"): "the models page: no parameters",
    ("dashboard:adapter_upload", "GET"): "the empty form",
    ("dashboard:model_compose", "GET"): "the empty form",
    ("dashboard:model_adapter", "GET"): "a model's archive by its name",
    ("dashboard:api_keys", "GET"): "the keys page: no parameters",
    ("tinker-healthz", "*"): "no input",
    ("tinker-telemetry", "*"): "the SDK's own events: read by nobody, kept by nobody",
    ("tinker-client-config", "*"): "no input: the server's flags for the SDK",
    ("tinker-server-capabilities", "*"): "the catalog: no parameters",
    ("tinker-training-run", "*"): "a training run by its id",
    ("tinker-run-checkpoints", "*"): "a training run's saved weights by its id",
    ("tinker-forward-backward", "*"): "a protobuf body, not JSON: its hostile bodies are tests/test_training_loops.py's",
    ("tinker-unknown", "*"): "any other path: a 404 naming it",
    ("tinker-finish-session", "*"): "a session by its id (the body's reason is not read)",
}


@dataclass(frozen=True)
class Hostile:
    """One kind of bad input: the raw JSON text and the form (or query) value it puts in the door's
    number or text field (None: not for that kind of door), or a whole body of its own."""

    name: str
    json_number: str | None = None
    json_text: str | None = None
    form_number: str | None = None
    form_text: str | None = None  # already percent-encoded
    body: Callable[[Door], bytes] | None = None  # replaces the body of JSON, FORM and MULTIPART doors
    expect: tuple[str, ...] = ()  # words of which the message (or the field it names) holds one, besides the field


HOSTILE = [
    Hostile("NaN", "NaN", form_number="NaN", expect=("nan",)),
    Hostile("Infinity", "Infinity", form_number="Infinity", expect=("infinity",)),
    Hostile("-Infinity", "-Infinity", form_number="-Infinity", expect=("infinity",)),
    Hostile("5,000-digit integer", HUGE_DIGITS, form_number=HUGE_DIGITS),
    Hostile("integer past 64 bits", PAST_64_BITS, form_number=PAST_64_BITS),
    Hostile("1e308", "1e308", form_number="1e308"),
    Hostile("1e400", "1e400", form_number="1e400"),
    Hostile("wrong type", '{"a": [1]}', '{"a": [1]}', form_number="twelve"),
    Hostile("NUL", json_text='"a\\u0000b"', form_text="a%00b", expect=("null", "nul")),
    # JSON only: a form or a query string is bytes that Django decodes as UTF-8, turning what would be a
    # surrogate (which UTF-8 cannot write) into U+FFFD, an ordinary character.
    Hostile("lone surrogate", json_text='"a\\ud800b"', expect=("surrogate", "escape")),
    Hostile("unknown field", body=lambda door: _json(door.valid | {"hostile_field": 1}), expect=("hostile_field",)),
    Hostile("deep nesting", body=lambda door: DEEP.encode(), expect=("nest", "deep", "recursion")),
    Hostile("empty body", body=lambda door: b"", expect=()),
    Hostile("huge body", body=lambda door: b"", expect=("bytes",)),  # sent by _huge_body, past the cap
    Hostile("5,000-digit Content-Length", body=lambda door: b"", expect=("bytes",)),  # sent by _huge_body too
]


def cells() -> Iterator[tuple[Door, Hostile]]:
    for door in DOORS:
        for hostile in HOSTILE:
            if _applies(door, hostile):
                yield door, hostile


def _applies(door: Door, hostile: Hostile) -> bool:
    if hostile.name in SIZE_CLASSES:
        return door.method != "GET"
    if door.reads == NOTHING:
        return False
    if hostile.body is not None:
        if hostile.name == "unknown field":  # a form's or a query's unknown fields are ignored, as browsers send extras
            return door.reads == JSON and not door.ignores_unknown_fields
        if hostile.name == "deep nesting":
            return door.reads == JSON
        return door.reads in (JSON, FORM, MULTIPART)
    if door.reads == JSON:
        return (door.number is not None and hostile.json_number is not None) or (
            door.text is not None and hostile.json_text is not None
        )
    if door.reads == MULTIPART:  # every multipart field is a string
        return door.text is not None and hostile.form_text is not None
    return (door.number is not None and hostile.form_number is not None) or (
        door.text is not None and hostile.form_text is not None
    )


def _json(value) -> bytes:
    return json.dumps(value).encode()


class Objects(dict):
    """alice's objects the paths and bodies name, made once for the whole corpus."""

    def __init__(self, alice: Persona):
        from accounts.services import create_api_key
        from django.core.files.uploadedfile import SimpleUploadedFile

        upload = SimpleUploadedFile("train.jsonl", good_dataset(12), content_type="application/jsonl")
        training = files.upload_file(alice.organization, alice.user, upload, files.PURPOSE)
        pairs_upload = SimpleUploadedFile("pairs.jsonl", preference_dataset(12), content_type="application/jsonl")
        pairs = files.upload_file(alice.organization, alice.user, pairs_upload, files.PURPOSE)
        prompts_upload = SimpleUploadedFile("prompts.jsonl", prompts_dataset(12), content_type="application/jsonl")
        prompts = files.upload_file(alice.organization, alice.user, prompts_upload, files.PURPOSE)
        job = FineTuningJob.objects.create(
            organization=alice.organization, model=BASE, training_file=training.id, suffix="hostile-job", seed=0,
            hyperparameters={"n_epochs": 1, "batch_size": 1, "learning_rate_multiplier": 1.0}, status=JobStatus.QUEUED,
        )
        evaluation = Eval.objects.create(
            organization=alice.organization, name="hostile", file_id=training.id, item_count=12,
            testing_criteria=[{"type": "contains", "name": "contains"}],
        )
        run = EvalRun.objects.create(
            eval=evaluation, organization=alice.organization, name="hostile", model=BASE, file_id=training.id,
            sampling={"max_completion_tokens": 8, "temperature": 0.0, "top_p": 1.0, "seed": None}, total_items=12,
        )
        webhook, _secret = endpoints.register(alice.organization, alice.user, "https://example.com/hook")
        batch_upload = SimpleUploadedFile("batch.jsonl", batch_lines(2), content_type="application/jsonl")
        batch_file = files.upload_file(alice.organization, alice.user, batch_upload, files.BATCH_PURPOSE)
        batch = Batch.objects.create(
            organization=alice.organization, input_file_id=batch_file.id, endpoint="/v1/chat/completions",
            completion_window="24h", total=2, expires_at=timezone.now() + timedelta(hours=24),
        )
        session = LoopSession.objects.create(organization=alice.organization)
        looprun = LoopRun.objects.create(
            id=f"{session.pk}:train:0", session=session, organization=alice.organization, base_model=BASE, lora_rank=8, status=RunStatus.RUNNING
        )
        LoopCheckpoint.objects.create(run=looprun, kind=CheckpointKind.STATE, name="hostile", storage_key="nowhere/")
        super().__init__(
            session=session.id, looprun=looprun.id,
            eval=evaluation.id, run=run.id, webhook=webhook.id, batch=batch.id, batchfile=batch_file.id,
            file=training.id, pairs=pairs.id, prompts=prompts.id, job=job.id, model=register_fine_tuned_model(alice, "hostile-model"),
            key=create_api_key(alice.organization, alice.user, "spare")[0].prefix, org=str(alice.organization.pk),
        )


def _filled(value, objects: Objects):
    if isinstance(value, str):
        return value.format_map(objects)
    if isinstance(value, dict):
        return {key: _filled(item, objects) for key, item in value.items()}
    if isinstance(value, list):
        return [_filled(item, objects) for item in value]
    return value


@dataclass
class Request:
    method: str
    path: str
    body: bytes = b""
    content_type: str | None = None


def _request(door: Door, hostile: Hostile, objects: Objects) -> Request:
    path, valid = door.path.format_map(objects), _filled(door.valid, objects)
    if hostile.body is not None:
        content_type = "application/json" if door.reads == JSON else "application/x-www-form-urlencoded"
        return Request(door.method, path, hostile.body(dataclasses.replace(door, valid=valid)), content_type)
    target = door.number if _number_class(door, hostile) else door.text
    if door.reads == JSON:
        raw = hostile.json_number if target == door.number else hostile.json_text
        text = json.dumps(_with(valid, target, MARK)).replace(json.dumps(MARK), raw or "")
        return Request(door.method, path, text.encode(), "application/json")
    value = hostile.form_number if target == door.number else hostile.form_text
    encoded = "&".join(f"{quote(name)}={quote(str(item))}" for name, item in valid.items() if name != target)
    encoded = f"{encoded}&{quote(target)}={value if value == hostile.form_text else quote(value or '')}".lstrip("&")
    if door.reads == QUERY:
        return Request(door.method, f"{path}?{encoded}")
    if door.reads == MULTIPART:
        return _multipart(door, path, valid, target, value or "")
    return Request(door.method, path, encoded.encode(), "application/x-www-form-urlencoded")


def _with(body: dict, path: str, value) -> dict:
    """``body`` with ``value`` at the dotted ``path`` (a field inside an object, ``hyperparameters.n_evals``,
    or a list's item)."""
    name, _, rest = path.partition(".")
    if isinstance(body, list):  # an item of a list: ``tools.0.function.name``
        items = list(body)
        items[int(name)] = _with(items[int(name)], rest, value) if rest else value
        return items
    return body | {name: _with(body.get(name, {}), rest, value) if rest else value}


def _number_class(door: Door, hostile: Hostile) -> bool:
    number = hostile.json_number if door.reads == JSON else hostile.form_number
    return door.number is not None and number is not None


def _multipart(door: Door, path: str, valid: dict, target: str, encoded_value: str) -> Request:
    """The fields as a browser sends them, the hostile one's bytes as they are, and a small file."""
    boundary = "hostileboundary"
    parts = [(name, str(value).encode()) for name, value in valid.items() if name != target]
    parts.append((target, unquote_to_bytes(encoded_value)))
    body = b"".join(
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode() + value + b"\r\n"
        for name, value in parts
    )
    file_field = "adapter-file" if path == "/models/upload" else "file"
    body += (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{file_field}"; filename="train.jsonl"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + good_dataset(2)
        + f"\r\n--{boundary}--\r\n".encode()
    )
    return Request(door.method, path, body, f"multipart/form-data; boundary={boundary}")


@dataclass
class Outcome:
    status: int
    problem: str | None  # what is wrong with the answer, if anything


def _answered(door: Door, hostile: Hostile, response) -> Outcome:
    status = response.status_code
    if status >= 500:
        return Outcome(status, f"a {status}: {response.content[:300]!r}")
    if hostile.name in SIZE_CLASSES:
        return Outcome(status, None if status == 413 else f"{status}, not 413")
    if door.reads == QUERY and door.lenient_query and status == 200:
        return Outcome(status, None)
    target = _target(door, hostile)
    wanted = hostile.expect + ((target.lower(),) if target else ())  # the problem, or the field it is in
    if target and "." in target:
        # A number too long for the parser to read leaves no parsed body to trace a path in: the refusal
        # names the key it sits under (core.strict_json), which is the field's own name.
        wanted += (target.lower().rpartition(".")[2],)
    if door.api:
        return Outcome(status, _api_refusal_problem(response, wanted))
    return Outcome(status, _page_refusal_problem(response, wanted))


def _target(door: Door, hostile: Hostile) -> str | None:
    if hostile.body is not None:
        return None
    name = door.number if _number_class(door, hostile) else door.text
    return (name or "").removeprefix("compose-").removeprefix("adapter-")


def _api_refusal_problem(response, wanted: tuple[str, ...]) -> str | None:
    if not 400 <= response.status_code < 500:
        return f"{response.status_code}, not a refusal"
    try:
        error = response.json()["error"]
        message, param = str(error["message"]), str(error.get("param") or "")
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI-shaped error: {response.content[:200]!r}"
    said = f"{message} {param}".lower()
    if wanted and not any(word in said for word in wanted):
        return f"the message names none of {wanted}: {message!r} (param {param!r})"
    return None


def _page_refusal_problem(response, wanted: tuple[str, ...]) -> str | None:
    """A form shown again with its errors, a 4xx, or a redirect back with an error message."""
    status = response.status_code
    if status == 302:
        flashed = [str(message) for message in get_messages(response.wsgi_request) if message.level_tag == "error"]
        return None if flashed else "a redirect with no error message: was it accepted?"
    text = response.content.decode(errors="replace")
    if status == 200 and 'role="alert"' not in text:
        return "the form again, with no error shown"
    if not (status == 200 or 400 <= status < 500):
        return f"{status}, not a refusal"
    return None


def _huge_body(door: Door, objects: Objects, application, declared: str | None = None) -> httpx.Response:
    """Over the cap for its path (``server.body_limits``): answered before Django, with no key or session.
    ``declared``: the Content-Length said, if not the real one."""
    from django.conf import settings

    over = settings.CONFIG.max_adapter_upload_bytes + 128 * 1024  # the largest cap of any path
    headers = {"content-type": "application/json", "content-length": declared or str(over)}

    async def send() -> httpx.Response:
        async def body():  # declared, and only its start sent: the cap answers on the declared length
            yield b"{" + b" " * 1024

        transport = httpx.ASGITransport(app=application, raise_app_exceptions=False)  # a crash is a 500 to count
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            return await client.request(door.method, door.path.format_map(objects), content=body(), headers=headers)

    return asyncio.run(send())


@pytest.fixture
def application():
    from django.core.asgi import get_asgi_application

    from gateway.asgi import with_fast_path
    from server.body_limits import with_body_limits

    return with_body_limits(with_fast_path(get_asgi_application()))


@pytest.fixture
def callers(alice) -> dict[bool, Client]:
    """By ``Door.session``: alice's API key, or alice signed in to the dashboard."""
    browser = Client(raise_request_exception=False)  # a 500 is an answer to count, not an error of the test
    browser.force_login(alice.user)
    return {
        False: Client(raise_request_exception=False, headers={"Authorization": f"Bearer {alice.key}", "X-API-Key": f"tml-{alice.key}"}),
        True: browser,
    }


def test_every_hostile_cell_is_refused_with_a_4xx_naming_the_problem_and_writes_nothing(
    alice, callers, application, settings, monkeypatch
):
    settings.INFERENCE_POOL_URL = "http://127.0.0.1:9"  # nothing listens: a completion let through is a 503
    monkeypatch.setattr(job_creation, "_send_or_503", lambda job: None)  # a job let through stays queued
    monkeypatch.setattr("evals.creation.send_to_worker", lambda run_id: None)  # an eval run let through too
    monkeypatch.setattr("batches.creation.send_to_worker", lambda batch_id: None)  # a batch too
    objects = Objects(alice)
    problems, statuses, count = [], {}, 0
    for door, hostile in cells():
        count += 1
        before = tenant_rows()
        if hostile.name in SIZE_CLASSES:
            declared = HUGE_DIGITS if hostile.name.endswith("Content-Length") else None
            response = _huge_body(door, objects, application, declared)
        else:
            request = _request(door, hostile, objects)
            client = callers[door.session]
            response = client.generic(request.method, request.path, request.body, request.content_type or "")
        outcome = _answered(door, hostile, response)
        statuses[outcome.status] = statuses.get(outcome.status, 0) + 1
        where = f"{door.method} {door.path} [{door.number or door.text}] x {hostile.name}"
        if outcome.problem:
            problems.append(f"{where}: {outcome.problem}")
        if (after := tenant_rows()) != before:
            problems.append(f"{where}: rows changed ({before} -> {after})")
    doors = len({(door.method, door.path) for door in DOORS})
    print(f"\nhostile corpus: {len(DOORS)} door rows ({doors} method and path pairs) x {len(HOSTILE)} classes")
    print(f"-> {count} cells (where the class applies); statuses {dict(sorted(statuses.items()))}")
    print(f"5xx: {sum(n for status, n in statuses.items() if status >= 500)}")
    assert count >= 250
    assert not problems, f"{len(problems)} of {count} cells:\n" + "\n".join(problems)


def _routes(patterns, prefix: str = "", namespace: str = "") -> Iterator[tuple[str, str, object]]:
    for entry in patterns:
        if isinstance(entry, URLResolver):
            inner = f"{namespace}{entry.namespace}:" if entry.namespace else namespace
            yield from _routes(entry.url_patterns, prefix + str(entry.pattern), inner)
        elif isinstance(entry, URLPattern) and entry.name:
            yield prefix + str(entry.pattern), f"{namespace}{entry.name}", entry.callback


def _methods(callback) -> set[str]:
    """A route's methods where the view says them (DRF's viewsets and views); "*" otherwise, and then
    any door on the route counts. HEAD is GET without the body."""
    from rest_framework.views import APIView

    if actions := getattr(callback, "actions", None):
        return {method.upper() for method in actions} - {"HEAD"}
    view_class = getattr(callback, "view_class", None) or getattr(callback, "cls", None)
    if isinstance(view_class, type) and issubclass(view_class, APIView):
        return {method.upper() for method in ("get", "post", "put", "patch", "delete") if hasattr(view_class, method)}
    return {"*"}


def test_every_route_has_a_door_or_a_reason_to_have_none():
    """A route under /v1/ or on the dashboard added without a row in DOORS (or EXCLUDED) fails here."""
    known = {(door.route, door.method) for door in DOORS} | set(EXCLUDED)
    names = {name for name, _method in known}
    missing = []
    for route, name, callback in _routes(get_resolver().url_patterns):
        if not (route.startswith(("v1/", "api/v1/")) or name.startswith("dashboard:")):
            continue
        for method in sorted(_methods(callback)):
            if (method == "*" and name not in names) or (method != "*" and (name, method) not in known):
                missing.append(f"{method} {route} ({name})")
    assert not missing, "routes the hostile corpus does not cover; add a Door (or an EXCLUDED reason):\n" + "\n".join(
        missing
    )
    stale = sorted(
        name for name in names if name not in {name for _route, name, _callback in _routes(get_resolver().url_patterns)}
    )
    assert not stale, f"doors for routes that no longer exist: {stale}"
