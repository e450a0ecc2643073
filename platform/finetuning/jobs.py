"""Fine-tuning jobs: creation (every check before anything is queued) and every change of status.

A job's status moves only here, each time with a conditional update, so two processes that race
(a worker and a cancel, two deliveries of one task, a sweeper and a late heartbeat) cannot both win:
queued -> running (``claim``) -> succeeded (``succeed``) or failed (``fail``); unfinished ->
cancelled (``cancel_job``); running with a stale heartbeat -> queued again (``recover_stale_jobs``).

``claim`` returns the attempt number, a fencing token: every later write of that run (heartbeat,
events, checkpoints, success, failure) is conditional on the job still running *that* attempt, so a
worker that was given up on but is still alive cannot overwrite what the next attempt does.

Fair share: organizations take turns at the trainers. A broker message only wakes a trainer;
``claim_next`` then claims the oldest queued job of the organization whose turn it is (``turn_order``:
fewest jobs running, then the one that started a job least recently), which need not be the job the
message names. That job, still queued, is sent again, so every queued job keeps a message and the
sweeper's accounting holds. So one organization's 50 jobs, queued first, do not make another's one
wait for all of them, even with a single trainer. An organization also trains at most
RUNNING_JOBS_PER_ORGANIZATION jobs at once: ``claim`` counts its running jobs under its lock
(``accounts.locks``, so two trainers cannot both take its last slot) and refuses a job over the cap.
A job refused for the cap stays queued, with no message, until a slot frees: the trainer that
finishes one of the organization's jobs sends its oldest waiting jobs (``send_waiting``), and the
sweeper sends any the hand-off missed (a trainer that died) once the organization has a free slot.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone as dt_timezone

from django.conf import settings
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.db.models import Count, F, Max, Min, QuerySet
from django.utils import timezone
from kombu.exceptions import OperationalError

from accounts.locks import lock_organization
from accounts.models import Organization
from base.celery import TRAIN_JOB, TRAINING_QUEUE, send
from core.api_errors import ApiError, not_found, suffix_taken
from core.catalog import BaseModel
from core.config import LIMIT_SETTINGS
from core.evaluation import Grader
from core.grading import first_problem
from core.rate_limits import RATE_LIMIT_TYPE
from core.model_names import ModelName, is_valid_suffix, parse_model_name
from finetuning import revisions
from finetuning.models import Composition, File, FineTunedModel, FineTuningJob, JobStatus, record_event

log = logging.getLogger(__name__)

AUTO = "auto"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BASE_LEARNING_RATE = 2e-4  # learning_rate_multiplier scales this (OpenAI's contract)
MAX_ATTEMPTS = 3


@dataclass
class JobRequest:
    """A validated request body (types already checked by the API layer)."""

    model: str
    training_file: str
    validation_file: str | None = None
    suffix: str | None = None
    seed: int | None = None
    hyperparameters: dict = field(default_factory=dict)
    metadata: dict | None = None
    evaluation: dict | None = None  # {"file", "graders", "threshold"}, checked for types already


def catalog_model(model_id: str) -> BaseModel:
    model = settings.MODEL_CATALOG.get(model_id)
    if model is None:
        available = ", ".join(settings.MODEL_CATALOG.ids)
        raise ApiError(f"Model '{model_id}' cannot be fine-tuned here; choose one of: {available}", param="model", code="model_not_available")
    return model


# What a continued fine-tune keeps of its parent: the adapter it goes on training has this shape.
PARENT_LORA = ("lora_r", "lora_alpha", "target_modules")


@dataclass(frozen=True)
class StartingPoint:
    """What a job trains from: a catalog base model, and maybe one of the organization's fine-tuned
    models of it (a continued fine-tune, as OpenAI allows: ``model`` = ``<base_model_id>:<suffix>``)."""

    base: BaseModel
    parent: FineTunedModel | None = None


def starting_point(organization: Organization, name: str) -> StartingPoint:
    parsed = parse_model_name(name)
    base = catalog_model(parsed.base_model_id)
    if parsed.suffix is None:
        return StartingPoint(base)
    parent = FineTunedModel.objects.for_org(organization).select_related("job").filter(name=name).first()
    if parent is None:  # another organization's model is not found either
        raise not_found("model", name, param="model")
    return StartingPoint(base, parent)


def parent_lora(parent: FineTunedModel) -> dict:
    """The parent adapter's rank, alpha and target modules, as the job that trained it recorded them."""
    if parent.job is None:
        kind = "a composed model" if parent.composition is not None else "an uploaded adapter"
        raise ApiError(
            f"{parent.name} is {kind}; only models trained here can be fine-tuned further.",
            param="model", code="model_not_continuable",
        )  # fmt: skip
    return {key: parent.job.hyperparameters[key] for key in PARENT_LORA}


def _keep_parent_lora(requested: dict, parent: FineTunedModel) -> dict:
    """``requested`` with the parent's adapter shape; a different value asked for is refused (the same is fine)."""
    kept = parent_lora(parent)
    for key, value in kept.items():
        asked = requested.get(key)
        same = asked is None or (sorted(asked) == sorted(value) if key == "target_modules" else asked == value)
        if not same:
            raise ApiError(
                f"{key}={asked} conflicts with {parent.name}'s {key}={value}: a fine-tune of a fine-tuned model "
                f"goes on training its adapter, so it keeps its {', '.join(PARENT_LORA)}. Leave {key} out.",
                param=f"hyperparameters.{key}", code="conflicts_with_parent_model",
            )  # fmt: skip
    return requested | kept


def _file(organization: Organization, file_id: str, param: str, model: BaseModel) -> File:
    file = File.objects.for_org(organization).filter(pk=file_id).first()
    if file is None:
        raise not_found("file", file_id, param=param)
    if file.max_example_tokens > model.engine.max_model_len:
        raise ApiError(
            f"File {file_id} has an example of {file.max_example_tokens} tokens; {model.id} takes at most "
            f"{model.engine.max_model_len}.", param=param, code="invalid_file",
        )  # fmt: skip
    return file


def chosen_suffix(requested: str | None) -> str:
    if requested is None:
        return "ft-" + secrets.token_hex(4)  # the platform names it; the unique constraint still guards
    if not is_valid_suffix(requested):
        raise ApiError(
            "suffix may hold only letters, digits, '-' and '_', at most 64 characters", param="suffix", code="invalid_suffix"
        )
    return requested


def resolve_hyperparameters(requested: dict, examples: int, model: BaseModel) -> dict:
    """Turn every "auto" into a number, so the job records exactly what it will train with."""
    batch_size = requested.get("batch_size", AUTO)
    batch_size = min(8, max(1, examples // 16)) if batch_size == AUTO else batch_size
    n_epochs = requested.get("n_epochs", AUTO)
    if n_epochs == AUTO:
        # Small datasets need more passes to show an effect (like OpenAI's "auto"): about 300
        # examples seen in all, between 3 and 10 epochs.
        n_epochs = 3 if examples >= 100 else min(10, max(3, -(-300 // examples)))
    multiplier = requested.get("learning_rate_multiplier", AUTO)
    multiplier = 1.0 if multiplier == AUTO else float(multiplier)
    lora_r = requested.get("lora_r", 8)
    if lora_r > model.lora.max_lora_rank:
        raise ApiError(
            f"lora_r={lora_r} exceeds {model.id}'s max_lora_rank of {model.lora.max_lora_rank}",
            param="hyperparameters.lora_r", code="invalid_hyperparameter",
        )  # fmt: skip
    target_modules = requested.get("target_modules") or list(TARGET_MODULES)
    unknown = sorted(set(target_modules) - set(TARGET_MODULES))
    if unknown:
        raise ApiError(
            f"target_modules has unknown modules {unknown}; choose from {list(TARGET_MODULES)}",
            param="hyperparameters.target_modules", code="invalid_hyperparameter",
        )  # fmt: skip
    return {
        "n_epochs": n_epochs,
        "batch_size": batch_size,
        "learning_rate_multiplier": multiplier,
        "lora_r": lora_r,
        "lora_alpha": requested.get("lora_alpha", 2 * lora_r),
        "lora_dropout": requested.get("lora_dropout", 0.05),
        "target_modules": target_modules,
    }


def _check_queued_cap(organization: Organization) -> None:
    cap = settings.CONFIG.limits.queued_jobs_per_organization
    if FineTuningJob.objects.for_org(organization).filter(status=JobStatus.QUEUED).count() >= cap:
        raise ApiError(
            f"{organization.name} already has {cap} queued fine-tuning jobs, its limit "
            f"({LIMIT_SETTINGS['queued_jobs_per_organization']}); create more once some have started.",
            status=429, type=RATE_LIMIT_TYPE, code="too_many_queued_jobs",
        )  # fmt: skip


def create_job(organization: Organization, user: User | None, request: JobRequest) -> FineTuningJob:
    _check_queued_cap(organization)  # a soft cap: two requests at once may both pass it
    start = starting_point(organization, request.model)
    model = start.base
    training = _file(organization, request.training_file, "training_file", model)
    validation = _file(organization, request.validation_file, "validation_file", model) if request.validation_file else None
    suffix = chosen_suffix(request.suffix)
    requested = request.hyperparameters
    if start.parent is not None:
        requested = _keep_parent_lora(requested, start.parent)
    hyperparameters = resolve_hyperparameters(requested, training.example_count, model)
    evaluation = _evaluation(organization, request.evaluation, validation, model)
    revision = _revision_to_publish(start.parent, ModelName(model.id, suffix))
    try:
        with transaction.atomic():
            job = FineTuningJob.objects.create(
                organization=organization, created_by=user, model=model.id,
                parent_model=start.parent.name if start.parent else None, training_file=training.id,
                validation_file=validation.id if validation else None, suffix=suffix, revision=revision,
                seed=request.seed if request.seed is not None else secrets.randbelow(2**31),
                hyperparameters=hyperparameters, metadata=request.metadata, evaluation=evaluation, status=JobStatus.QUEUED,
                queued_at=timezone.now(),
            )  # fmt: skip
            record_event(job, f"Validated training file: {training.example_count} examples, {training.token_count} tokens")
            record_event(job, f"Job queued; {_jobs_ahead_phrase(job)}")
            # Only after the commit can a worker see the job; a rolled-back job is never sent.
            transaction.on_commit(lambda: _send_or_503(job))
    except IntegrityError:
        raise suffix_taken(str(ModelName(model.id, suffix))) from None
    return job


def _evaluation(organization: Organization, requested: dict | None, validation: File | None, model: BaseModel) -> dict | None:
    """The evaluation as the job keeps it: its file resolved (the validation file by default), its
    graders checked (a pattern that does not compile, a schema too large or pointing elsewhere)."""
    if requested is None:
        return None
    graders = [Grader(grader["type"], grader.get("pattern"), grader.get("schema")) for grader in requested["graders"]]
    problem = first_problem(graders)  # checked in a separate process, with limits (core.grading)
    if problem is not None:
        index, field, message = problem
        param = f"evaluation.graders[{index}].{field}"
        raise ApiError(f"{param}: {message}", param=param, code="invalid_grader")
    file_id = requested.get("file")
    if file_id is None:
        if validation is None:
            raise ApiError(
                "An evaluation needs held-out examples: give evaluation.file, or a validation_file to evaluate on.",
                param="evaluation.file", code="evaluation_needs_a_file",
            )  # fmt: skip
        file_id = validation.id
    else:
        _file(organization, file_id, "evaluation.file", model)
    return {**requested, "file": file_id}


def _revision_to_publish(parent: FineTunedModel | None, name: ModelName) -> int:
    """1 for a new suffix; the next revision when the job continues the model of its own suffix (a
    job reserves its revision at creation, so two such jobs publish r2 and r3, never both r2)."""
    if parent is not None and parent.name == str(name):
        reserved = FineTuningJob.objects.filter(model=name.base_model_id, suffix=name.suffix).aggregate(Max("revision"))
        published = parent.revisions.aggregate(Max("number"))
        return max(reserved["revision__max"] or 0, published["number__max"] or 0, parent.revision) + 1
    if FineTunedModel.objects.filter(name=str(name)).exists():  # an uploaded or composed adapter's
        raise suffix_taken(str(name))
    if Composition.objects.unfinished().filter(model=str(name)).exists():  # a composition under way publishes it
        raise suffix_taken(str(name))
    return 1


def send_to_trainer(job_id: str) -> None:
    """Wake a trainer for a queued job. Sending twice is harmless: only one ``claim`` wins."""
    send(TRAIN_JOB, job_id)


def _send_or_503(job: FineTuningJob) -> None:
    try:
        send_to_trainer(job.id)
    except OperationalError as exc:  # the broker is down; the job stays queued for the sweeper
        log.warning("job %s is queued but could not be sent to a trainer: %s", job.id, exc)
        record_event(
            job, "The job could not be sent to a trainer (the broker is unreachable); it is sent again once the broker is back",
            level="warn",
        )  # fmt: skip
        raise ApiError(
            f"Job {job.id} was created and is queued, but the task broker is unreachable, so no trainer has been told yet. "
            "It starts by itself once the broker is back; do not create it again.",
            status=503, code="broker_unavailable",
        ) from None  # fmt: skip


_NEVER = datetime.min.replace(tzinfo=dt_timezone.utc)


@dataclass(frozen=True)
class Turn:
    organization_id: int
    running: int  # its jobs running now
    queued: int  # its jobs waiting


def turn_order() -> list[Turn]:
    """Organizations with queued jobs, in the order they get the next free trainer: fewest jobs
    running first, then the one whose last job started longest ago (one that never started a job
    first), then the one whose oldest job has waited longest."""
    queued = FineTuningJob.objects.filter(status=JobStatus.QUEUED).values("organization_id")
    waiting = {row["organization_id"]: row for row in queued.annotate(count=Count("pk"), oldest=Min("queued_at"))}
    if not waiting:
        return []
    of_them = FineTuningJob.objects.filter(organization_id__in=waiting).values("organization_id")
    running = dict(of_them.filter(status=JobStatus.RUNNING).annotate(n=Count("pk")).values_list("organization_id", "n"))
    last_start = dict(of_them.filter(started_at__isnull=False).annotate(last=Max("started_at")).values_list("organization_id", "last"))
    order = sorted(waiting, key=lambda org: (running.get(org, 0), last_start.get(org) or _NEVER, waiting[org]["oldest"] or _NEVER))
    return [Turn(org, running.get(org, 0), waiting[org]["count"]) for org in order]


def _jobs_ahead(job: FineTuningJob) -> int:
    """About how many jobs a trainer takes before this queued one: those running, then, turn by
    turn (``turn_order``), its organization's earlier jobs and as many of every other
    organization's (ignoring the running-job caps)."""
    running = FineTuningJob.objects.filter(status=JobStatus.RUNNING).count()
    own_earlier = FineTuningJob.objects.filter(
        organization_id=job.organization_id, status=JobStatus.QUEUED, queued_at__lt=job.queued_at
    ).count()
    turns = turn_order()
    mine = next((i for i, turn in enumerate(turns) if turn.organization_id == job.organization_id), len(turns))
    others = sum(
        min(turn.queued, own_earlier + (1 if i < mine else 0))
        for i, turn in enumerate(turns) if turn.organization_id != job.organization_id
    )  # fmt: skip
    return running + own_earlier + others


def _jobs_ahead_phrase(job: FineTuningJob) -> str:
    ahead = _jobs_ahead(job)
    return "no job ahead" if ahead == 0 else f"{ahead} job{'s' if ahead > 1 else ''} ahead"


def _running_count(organization_id: int) -> int:
    return FineTuningJob.objects.filter(organization_id=organization_id, status=JobStatus.RUNNING).count()


def _cap_note(running: int) -> str:
    return (
        f"Waiting: the organization already runs {running} job{'s' if running > 1 else ''}, its limit "
        f"({LIMIT_SETTINGS['running_jobs_per_organization']}); the job starts when one of them finishes"
    )


def waiting_note(job: FineTuningJob, trainers: int) -> str:
    """What a queued job waits for, as its events say it."""
    running = _running_count(job.organization_id)
    if running >= settings.CONFIG.limits.running_jobs_per_organization:
        return _cap_note(running)
    if trainers == 0:
        return f"No trainer is connected to the '{TRAINING_QUEUE}' queue; the job starts when one connects"
    return f"Waiting for a trainer: {_jobs_ahead_phrase(job)}"


def cancel_job(job: FineTuningJob) -> FineTuningJob:
    # Conditional, so a job that finished a moment ago is not turned into "cancelled".
    updated = (
        FineTuningJob.objects.filter(pk=job.pk, status__in=(JobStatus.QUEUED, JobStatus.RUNNING))
        .update(status=JobStatus.CANCELLED, finished_at=timezone.now())
    )  # fmt: skip
    job.refresh_from_db()
    if not updated:
        raise ApiError(f"Job {job.id} has already {job.status}; only unfinished jobs can be cancelled.", status=409, code="job_finished")
    record_event(job, "Job cancelled by request")
    return job


def claim(job_id: str, worker: str) -> int | None:
    """queued -> running, for exactly one worker: its attempt number, or None when another worker
    has the job, it is no longer queued, or its organization already runs its cap of jobs (then it
    stays queued, and says so, until ``send_waiting`` or the sweeper sends it again)."""
    organization_id = FineTuningJob.objects.filter(pk=job_id).values_list("organization_id", flat=True).first()
    if organization_id is None:
        return None
    with transaction.atomic():
        lock_organization(organization_id)  # until the commit: the count below stays true
        running = _running_count(organization_id)
        if running >= settings.CONFIG.limits.running_jobs_per_organization:
            claimed = 0
        else:
            now = timezone.now()
            claimed = FineTuningJob.objects.filter(pk=job_id, status=JobStatus.QUEUED).update(
                status=JobStatus.RUNNING, worker=worker, started_at=now, heartbeat_at=now, attempts=F("attempts") + 1
            )
    if not claimed:
        _note_waiting_for_a_slot(job_id, running)
        return None
    return FineTuningJob.objects.filter(pk=job_id).values_list("attempts", flat=True).get()


def _note_waiting_for_a_slot(job_id: str, running: int) -> None:
    job = FineTuningJob.objects.filter(pk=job_id, status=JobStatus.QUEUED).first()
    if job is None or running < settings.CONFIG.limits.running_jobs_per_organization:
        return  # claimed by another worker, or no longer queued: nothing to say
    note = _cap_note(running)
    if job.events.filter(type="message").values_list("message", flat=True).first() != note:
        record_event(job, note)  # once, however many times it is refused


@dataclass(frozen=True)
class Claim:
    job_id: str
    attempt: int


def claim_next(woken_by: str, worker: str) -> Claim | None:
    """For a trainer woken by job ``woken_by``'s message: claim the oldest queued job of the
    organization whose turn it is (fair share; not necessarily ``woken_by``), and send
    ``woken_by`` again when it was passed over, so it keeps a message. None when ``woken_by`` is
    no longer queued (its message is spent) or no organization with a waiting job has a free slot."""
    woken_organization = (
        FineTuningJob.objects.filter(pk=woken_by, status=JobStatus.QUEUED).values_list("organization_id", flat=True).first()
    )
    if woken_organization is None:
        return None
    cap = settings.CONFIG.limits.running_jobs_per_organization
    for turn in turn_order():
        if turn.running >= cap:
            continue
        job_id = (
            FineTuningJob.objects.filter(organization_id=turn.organization_id, status=JobStatus.QUEUED)
            .order_by("queued_at").values_list("pk", flat=True).first()
        )  # fmt: skip
        attempt = claim(job_id, worker) if job_id else None
        if job_id and attempt is not None:
            if job_id != woken_by:
                _send_again(woken_by)
            return Claim(job_id, attempt)
    _note_waiting_for_a_slot(woken_by, _running_count(woken_organization))
    return None


def _send_again(job_id: str) -> bool:
    """Send a queued job to the trainers again; a send that fails (the broker went away) leaves it
    to the sweeper, which sends a job whose message it finds missing."""
    try:
        send_to_trainer(job_id)
    except OperationalError as exc:
        log.warning("could not send job %s to a trainer: %s", job_id, exc)
        return False
    return True


def free_slots(organization_id: int) -> int:
    """How many more of the organization's jobs may run now."""
    return max(0, settings.CONFIG.limits.running_jobs_per_organization - _running_count(organization_id))


def send_waiting(organization_id: int) -> list[str]:
    """Send the organization's oldest queued jobs, as many as it has free slots: for a trainer that
    has just finished one of its jobs. A job whose message is still in the broker is sent twice,
    which is harmless (one ``claim`` wins)."""
    waiting = FineTuningJob.objects.filter(organization_id=organization_id, status=JobStatus.QUEUED)
    oldest = waiting.order_by("queued_at").values_list("pk", flat=True)[: free_slots(organization_id)]
    return [job_id for job_id in oldest if _send_again(job_id)]


def _this_attempt(job_id: str, attempt: int) -> QuerySet[FineTuningJob]:
    return FineTuningJob.objects.filter(pk=job_id, status=JobStatus.RUNNING, attempts=attempt)


def heartbeat(job_id: str, attempt: int, **fields: object) -> bool:
    """Say the attempt's worker is alive; False when the job no longer runs this attempt (cancelled,
    or given up on and queued again): the attempt must stop, and write nothing more."""
    return bool(_this_attempt(job_id, attempt).update(heartbeat_at=timezone.now(), **fields))


def succeed(
    job: FineTuningJob, attempt: int, name: str, trained_tokens: int, final_loss: float | None, results: File | None = None
) -> bool:
    """running -> succeeded, with its model in the registry and its ``results`` file (stored, not yet
    saved: ``finetuning.results``); False when this attempt lost the job meanwhile (cancelled, or
    another attempt runs it)."""
    with transaction.atomic():
        succeeded = _this_attempt(job.pk, attempt).update(
            status=JobStatus.SUCCEEDED, fine_tuned_model=name, trained_tokens=trained_tokens,
            finished_at=timezone.now(), estimated_finish=None, result_file=results.id if results else None,
        )  # fmt: skip
        if succeeded:
            if results is not None:
                results.save()
            revisions.register(job, name, final_loss)
            record_event(job, "The job has successfully completed")
    return bool(succeeded)


def record_evaluation(job_id: str, attempt: int, scores: dict) -> None:
    """Keep the evaluation gate's scores on the job (only while this attempt runs it)."""
    job = _this_attempt(job_id, attempt).first()
    if job is not None and job.evaluation is not None:
        _this_attempt(job_id, attempt).update(evaluation=job.evaluation | {"scores": scores})


def fail(job_id: str, attempt: int, code: str, message: str) -> None:
    """running -> failed, with the reason the user reads (only while this attempt runs the job)."""
    failed = _this_attempt(job_id, attempt).update(
        status=JobStatus.FAILED, error_code=code, error_message=message, finished_at=timezone.now(), estimated_finish=None
    )
    if failed:
        record_event(FineTuningJob.objects.get(pk=job_id), f"Job failed: {message}", level="error")


def status_of(job_id: str) -> str:
    return FineTuningJob.objects.filter(pk=job_id).values_list("status", flat=True).get()


def stale_after() -> timedelta:
    return timedelta(seconds=settings.CONFIG.job_stale_after_s)


@dataclass
class Recovered:
    requeued: list[str] = field(default_factory=list)  # for the caller to send to a trainer
    failed: list[str] = field(default_factory=list)  # worker_lost: no attempt will resume them


def recover_stale_jobs(stale_after: timedelta) -> Recovered:
    """Running jobs whose worker stopped sending heartbeats go back to queued, or fail after
    MAX_ATTEMPTS."""
    recovered = Recovered()
    now = timezone.now()
    for job in FineTuningJob.objects.filter(status=JobStatus.RUNNING, heartbeat_at__lt=now - stale_after):
        # Conditional on the heartbeat we saw: a worker that is alive after all keeps its job.
        still_stale = FineTuningJob.objects.filter(pk=job.pk, status=JobStatus.RUNNING, heartbeat_at=job.heartbeat_at)
        if job.attempts >= MAX_ATTEMPTS:
            message = f"The worker running this job stopped responding {job.attempts} times; giving up."
            if still_stale.update(status=JobStatus.FAILED, error_code="worker_lost", error_message=message, finished_at=now):
                record_event(job, f"Job failed: {message}", level="error")
                recovered.failed.append(job.pk)
        elif still_stale.update(status=JobStatus.QUEUED, worker="", heartbeat_at=None, queued_at=now):
            record_event(job, f"Worker {job.worker} stopped responding; the job is queued again", level="warn")
            recovered.requeued.append(job.pk)
    return recovered


def mark_sent_again(job: FineTuningJob) -> bool:
    """For a queued job whose message the broker lost: restart its wait, conditionally (it may
    have been claimed a moment ago). True when the caller should send it."""
    resent = FineTuningJob.objects.filter(pk=job.pk, status=JobStatus.QUEUED, queued_at=job.queued_at).update(queued_at=timezone.now())
    if resent:
        record_event(job, "The job's message to the trainers was lost (a broker restart?); it is sent again", level="warn")
    return bool(resent)
