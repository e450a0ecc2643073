"""Creating evals and starting their runs: everything that can refuse is checked first (the item
schema and the graders in the sandbox's process, every item against the schema, every model the
caller names, judges included, each item's prompt), then the rows are written and, once committed,
each run's id is sent to the ``default`` queue (``workers.run_eval`` scores it). A refusal writes
nothing and queues nothing."""

from __future__ import annotations

import logging

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from kombu.exceptions import OperationalError

from accounts.locks import lock_organization
from accounts.models import Organization
from answering.access import usable_target
from answering.batch import Target
from base.celery import RUN_EVAL, send
from core.api_errors import ApiError
from core.eval_items import EvalItem
from core.eval_prompts import DEFAULT_INPUT, input_messages_problem, prompt_of
from core.evaluation import Grader
from core.grading import first_problem
from core.rate_limits import RATE_LIMIT_TYPE
from core.request_limits import check_request
from evals import run_status, sources
from evals.criteria import checked_criteria
from evals.models import Eval, EvalRun
from evals.requests import DataSource, EvalCreate, RunCreate

log = logging.getLogger(__name__)

RUNS_AT_ONCE_PER_ORGANIZATION = 16  # queued or in progress: each holds the engine for a while
RETRY_AT_ONCE_S = 30


def create_eval(organization: Organization, user: User | None, request: EvalCreate) -> Eval:
    config = request.data_source_config
    schema = config.item_schema if config is not None else None
    if schema is None and request.file is None:
        raise ApiError(
            "Say what an item holds: data_source_config {\"type\": \"custom\", \"item_schema\": {...}}, or (the "
            "platform's shape) file: a chat file whose examples are the items.",
            param="data_source_config.item_schema", code="missing_item_schema",
        )
    if schema is not None:
        _check_item_schema(schema)
    criteria = checked_criteria(organization, request.testing_criteria)
    evaluation = Eval(
        organization=organization, created_by=user, name=request.name or f"eval of {request.file or 'custom items'}",
        item_schema=schema, include_sample_schema=bool(config and config.include_sample_schema),
        testing_criteria=criteria, metadata=request.metadata,
    )
    if request.file is not None:
        items = sources.file_items(organization, request.file, "file")
        sources.check_items(evaluation, items, "file", in_file=True)
        evaluation.file_id, evaluation.item_count = request.file, len(items)
    evaluation.save()
    return evaluation


def _check_item_schema(schema: dict) -> None:
    """A JSON Schema of bounded size that fetches nothing, compiled in the sandbox's process."""
    problem = first_problem([Grader("json_schema", schema=schema)])
    if problem is not None:
        _index, _field, message = problem
        raise ApiError(f"data_source_config.item_schema: {message}", param="data_source_config.item_schema", code="invalid_item_schema")


def start_runs(organization: Organization, user: User | None, evaluation: Eval, request: RunCreate) -> list[EvalRun]:
    """One run per model the request names (``data_source.model``, then ``models``), all on the same
    items and sampling; one run without a model for a ``jsonl`` data source (its items bring their
    samples); queued once committed."""
    targets: list[tuple[str, Target | None]] = list(request.targets())
    if request.data_source.type == "jsonl":
        if targets:
            raise ApiError(
                "A jsonl data source grades the samples its items bring; name no model (or use type completions).",
                param="data_source.model", code="invalid_value",
            )
        targets = [("data_source", None)]
    elif not targets:
        raise ApiError(
            "Name the model to run: data_source.model, or several in models (one run each).",
            param="data_source.model", code="missing_model",
        )
    for where, target in targets:
        if target is not None:
            usable_target(organization, target, where)
    file_id, items, count, data_source = _items(organization, evaluation, request.data_source)
    if request.data_source.type != "jsonl":
        _check_requests(request, items, data_source["input_messages"])
    with transaction.atomic():
        lock_organization(organization.pk)  # until the commit: the count below stays true
        _check_at_once(organization, len(targets))
        runs = [
            _run(organization, user, evaluation, request, target, file_id, data_source, count, len(targets))
            for _where, target in targets
        ]
        transaction.on_commit(lambda: _send_or_503(runs))
    return runs


def _items(organization: Organization, evaluation: Eval, data_source: DataSource) -> tuple[str, list[EvalItem] | None, int, dict]:
    """The run's file (or ""), its items when they were read here (None: the eval's own file,
    checked when the eval was created), their count, and the data source as the run keeps it. Each
    item read is checked against the eval's item schema; a jsonl source's must each bring a sample."""
    source = data_source.source
    kept: dict = {"type": data_source.type}
    items: list[EvalItem] | None
    if source is None:
        if not evaluation.file_id:
            raise ApiError(
                "This eval has no file of its own: give data_source.source (file_content or file_id).",
                param="data_source.source", code="missing_source",
            )
        if data_source.type == "jsonl":
            raise ApiError(
                "A jsonl data source grades the samples its items bring: give data_source.source.",
                param="data_source.source", code="missing_source",
            )
        file_id, items, count = evaluation.file_id, None, evaluation.item_count
        kept["source"] = {"type": "file_id", "id": file_id}
    elif source.type == "file_content":
        items = sources.content_items(source.content or [], "data_source.source.content")
        sources.check_items(evaluation, items, "data_source.source.content")
        file_id, count, kept["source"] = "", len(items), {"type": "file_content", "content": [item.entry() for item in items]}
    else:
        if source.id is None:
            raise ApiError("data_source.source.id: name the file", param="data_source.source.id", code="invalid_value")
        file_id, items = source.id, sources.file_items(organization, source.id, "data_source.source.id")
        sources.check_items(evaluation, items, "data_source.source.id", in_file=True)
        count, kept["source"] = len(items), {"type": "file_id", "id": file_id}
    if data_source.type == "jsonl":
        missing = next((index for index, item in enumerate(items or []) if item.sample is None), None)
        if missing is not None:
            raise ApiError(
                f"data_source.source: item {missing + 1} has no sample; a jsonl data source grades the samples its "
                "items bring ({\"item\": {...}, \"sample\": {\"output_text\": ...}}).",
                param="data_source.source", code="invalid_item",
            )
    else:
        messages = data_source.input_messages
        kept["input_messages"] = messages.model_dump(exclude_none=True) if messages is not None else DEFAULT_INPUT
        problem = input_messages_problem(kept["input_messages"])
        if problem is not None:
            field, message = problem
            param = f"data_source.input_messages.{field}"
            raise ApiError(f"{param}: {message}", param=param, code="invalid_value")
    return file_id, items, count, kept


def _check_requests(request: RunCreate, items: list[EvalItem] | None, input_messages: dict) -> None:
    """The sampling makes a request the gateway would take (its tools included), and each item read
    here makes a prompt within the request caps: a run never queues what cannot be asked. (The
    eval's own file's examples were checked against the model's context at upload.)"""
    sampling = request.sampling().fields()
    _check_request({"model": "any", "messages": [{"role": "user", "content": "?"}], **sampling}, "sampling")
    for index, item in enumerate(items or []):
        prompt, problem = prompt_of(input_messages, item.item)
        if prompt is None:
            raise ApiError(f"data_source.input_messages: item {index + 1}: {problem}", param="data_source.input_messages", code="invalid_item")
        _check_request({"model": "any", "messages": prompt, **sampling}, f"item {index + 1}'s request")


def _check_request(body: dict, what: str) -> None:
    try:
        check_request(body, "chat/completions", settings.CONFIG.request_limits)
    except ApiError as exc:
        exc.message = f"{what}: {exc.message}"
        sampled = exc.param is not None and exc.param.split(".")[0] == "tools"
        exc.param = f"data_source.sampling_params.{exc.param}" if sampled else "data_source"
        raise


def _run(
    organization: Organization, user: User | None, evaluation: Eval, request: RunCreate, target: Target | None,
    file_id: str, data_source: dict, items: int, of: int,
) -> EvalRun:
    model = target.model if target is not None else ""
    name = request.name or model or "jsonl samples"
    if request.name and of > 1:
        name = f"{request.name} ({model})"
    adapters = [{"model": name, "scale": scale} for name, scale in target.adapters] if target else None
    return EvalRun.objects.create(
        eval=evaluation, organization=organization, created_by=user, name=name[:256], model=model,
        adapters=adapters or None, file_id=file_id, data_source=data_source, sampling=request.sampling().fields(),
        metadata=request.metadata, total_items=items,
    )


def _check_at_once(organization: Organization, adding: int) -> None:
    under_way = EvalRun.objects.for_org(organization).unfinished().count()
    if under_way + adding > RUNS_AT_ONCE_PER_ORGANIZATION:
        raise ApiError(
            f"{organization.name} has {under_way} eval runs queued or in progress; with {adding} more it would pass "
            f"its limit of {RUNS_AT_ONCE_PER_ORGANIZATION}. Try again in about {RETRY_AT_ONCE_S} s, once some have "
            "finished (or cancel some).",
            status=429, type=RATE_LIMIT_TYPE, code="too_many_eval_runs", retry_after_s=RETRY_AT_ONCE_S,
        )


def send_to_worker(run_id: str) -> None:
    """Wake a worker for a queued run. Sending twice is harmless: only one ``claim`` wins."""
    send(RUN_EVAL, run_id)


def _send_or_503(runs: list[EvalRun]) -> None:
    try:
        for run in runs:
            send_to_worker(run.id)
    except OperationalError as exc:  # the broker is down: fail what was not started, say so
        log.warning("eval runs could not be sent to a worker: %s", exc)
        for run in runs:
            run_status.fail(run.id, "broker_unavailable", "The task broker was unreachable, so no worker was told. Start the run again.")
        raise ApiError(
            "The runs could not be started: the task broker is unreachable. Start them again shortly.",
            status=503, code="broker_unavailable", retry_after_s=5,
        ) from None
