"""Creating fine-tuning jobs: every check before anything is queued, then the job, queued, sent to
the trainers once it is committed.

A job names what it trains from (a catalog base model, or an adapter of the organization's on it:
a fine-tuned model, a revision of one or a checkpoint, trained here, uploaded or composed: a
continued fine-tune, which trains on from exactly that adapter), its files (each within the model's context), its suffix
(free, or its own model's: then it reserves the next revision) and its hyperparameters (every
"auto" resolved here, so the job records exactly what it will train with). Which job a trainer
takes next is decided in ``finetuning.training_turns``; how a job's status moves after that, in
``finetuning.job_status``.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field

from django.conf import settings
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.db.models import Max
from django.utils import timezone
from kombu.exceptions import OperationalError

from accounts.models import Organization
from core.adapter_check import lora_shape
from core.adapter_store import CONFIG_FILE, AdapterNotFound, StoreUnavailable
from core.api_errors import (
    ApiError,
    InvalidAdapter,
    adapter_not_found,
    adapter_store_unreachable,
    model_not_found,
    not_found,
    suffix_taken,
)
from core.catalog import BaseModel
from core.config import LIMIT_SETTINGS
from core.datasets import CHAT, FORMAT_SHAPES, PREFERENCE, PROMPTS
from core.evaluation import GRADERS
from core.graders.spec import checked_grader, judge_models
from core.loop_lora import LORA_ALPHA
from core.grading import first_own_problem
from core.rate_limits import RATE_LIMIT_TYPE
from core.model_names import ModelName, is_valid_suffix, parse_model_name, with_revision
from finetuning import publishing, registry, training_turns
from finetuning.files import PURPOSE as FINE_TUNE_PURPOSE
from finetuning.models import (
    DPO,
    METHODS,
    REINFORCEMENT,
    SUPERVISED,
    Composition,
    File,
    FineTunedModel,
    FineTuningJob,
    JobStatus,
    record_event,
)

log = logging.getLogger(__name__)

AUTO = "auto"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BASE_LEARNING_RATE = 2e-4  # learning_rate_multiplier scales this (OpenAI's contract)
# Validation passes cost about as much as training on the validation sample each time, and every
# checkpoint is an adapter published to the dynamic LoRA path: both are bounded per epoch.
MAX_EVALS_PER_EPOCH = 20
MAX_CHECKPOINTS_PER_EPOCH = 10

# The file format each method trains on.
METHOD_FORMAT = {SUPERVISED: CHAT, DPO: PREFERENCE, REINFORCEMENT: PROMPTS}
# DPO's beta: "auto" is 0.1 (OpenAI's and the DPO paper's usual value). Past the bounds the loss is flat
# (a tiny beta: every margin near 0) or saturated at once (a large one), so they catch typos.
DPO_BETA_AUTO = 0.1
MIN_BETA, MAX_BETA = 0.001, 10.0
# Reinforcement: compute_multiplier scales the samples drawn per prompt (a group, whose rewards are
# compared with each other), from this many; at least 2, or a group has nothing to compare.
SAMPLES_PER_PROMPT = 4
MAX_SAMPLES_PER_PROMPT = 32
REASONING_EFFORTS = ("default", "low", "medium", "high")  # OpenAI's; only "default" for a model that does not reason
REINFORCEMENT_KEYS = (
    "n_epochs", "batch_size", "learning_rate_multiplier", "eval_interval", "eval_samples", "compute_multiplier",
    "reasoning_effort", "lora_r", "early_stopping", "max_completion_tokens",
)
MAX_COMPLETION_TOKENS_AUTO = 256  # an answer's length, at most (the platform's; OpenAI's models decide their own)


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
    method: str = SUPERVISED  # one of METHODS
    grader: dict | None = None  # reinforcement's, as given (checked here)


def catalog_model(model_id: str) -> BaseModel:
    model = settings.MODEL_CATALOG.get(model_id)
    if model is None:
        available = ", ".join(settings.MODEL_CATALOG.ids)
        raise ApiError(f"Model '{model_id}' cannot be fine-tuned here; choose one of: {available}", param="model", code="model_not_available")
    return model


# What a continued fine-tune keeps of its parent: the adapter it goes on training has this shape.
PARENT_LORA = ("lora_r", "lora_alpha", "target_modules")


@dataclass(frozen=True)
class Parent:
    """The adapter a continued fine-tune trains on from (as OpenAI allows, ``model`` names it)."""

    name: str  # as the caller named it: <base_model_id>:<suffix>, ...@r<N> or ...:ckpt-step-<N>
    exact: str  # exactly that adapter, by a name that never changes what it names (a revision or a checkpoint)
    lora: dict  # its PARENT_LORA
    model: FineTunedModel | None  # the fine-tuned model it is a revision of (a checkpoint's, if published)
    revision: int | None  # the revision a bare name answered with (recorded: the job trains from it)


@dataclass(frozen=True)
class StartingPoint:
    """What a job trains from: a catalog base model, and maybe an adapter of the organization's on it."""

    base: BaseModel
    parent: Parent | None = None


def starting_point(organization: Organization, name: str) -> StartingPoint:
    parsed = parse_model_name(name)
    base = catalog_model(parsed.base_model_id)
    if parsed.suffix is None:
        return StartingPoint(base)
    if parsed.checkpoint_step is not None:
        return StartingPoint(base, _checkpoint_parent(organization, name, parsed))
    return StartingPoint(base, _revision_parent(organization, name, parsed, base))


def _checkpoint_parent(organization: Organization, name: str, parsed: ModelName) -> Parent:
    """A checkpoint of one of the organization's jobs (while it trains, or after), as the job lists it."""
    checkpoint = registry.checkpoint_named(organization, parsed)
    if checkpoint is None:  # another organization's is not found either
        raise not_found("model", name, param="model")
    model = FineTunedModel.objects.for_org(organization).filter(name=parsed.model).first()
    return Parent(name, name, _trained_lora(checkpoint.job), model, None)


def _revision_parent(organization: Organization, name: str, parsed: ModelName, base: BaseModel) -> Parent:
    """A fine-tuned model at the revision it answers with now, or at the one ``@r<N>`` pins."""
    model = FineTunedModel.objects.for_org(organization).filter(name=parsed.model).first()
    if model is None:  # another organization's model is not found either
        raise not_found("model", name, param="model")
    number = parsed.revision or model.revision
    revision = model.revisions.select_related("job").filter(number=number).first()
    if revision is None:
        known = ", ".join(f"r{n}" for n in model.revisions.values_list("number", flat=True))
        raise not_found("model", f"{name} ({model.name} has {known})", param="model")
    exact = with_revision(model.name, number)
    lora = _trained_lora(revision.job) if revision.job else _published_lora(exact, base)
    return Parent(name, exact, lora, model, None if parsed.revision else number)


def _trained_lora(job: FineTuningJob) -> dict:
    """A trained adapter's shape, as the job that trained it recorded it."""
    return {key: job.hyperparameters[key] for key in PARENT_LORA}


def _published_lora(exact: str, base: BaseModel) -> dict:
    """An uploaded or composed adapter's shape: no job here trained it, so it is read from its own
    ``adapter_config.json`` and checked as an upload's is (the catalog's rank limit may have changed)."""
    try:
        config = publishing.store_for(base.id).config(exact)
    except AdapterNotFound:
        raise adapter_not_found(exact) from None
    except StoreUnavailable as exc:
        raise adapter_store_unreachable(exact, str(exc)) from None
    try:
        shape = lora_shape(config, base)
    except InvalidAdapter as error:
        raise ApiError(
            f"{exact} cannot be fine-tuned further: its {CONFIG_FILE} is not one training can go on from "
            f"({error.problem}).", param="model", code="model_not_continuable",
        ) from None
    return {"lora_r": shape.rank, "lora_alpha": shape.alpha, "target_modules": list(shape.target_modules)}


def _keep_parent_lora(requested: dict, parent: Parent) -> dict:
    """``requested`` with the parent's adapter shape; a different value asked for is refused (the same is fine)."""
    for key, value in parent.lora.items():
        asked = requested.get(key)
        same = asked is None or (sorted(asked) == sorted(value) if key == "target_modules" else asked == value)
        if not same:
            raise ApiError(
                f"{key}={asked} conflicts with {parent.exact}'s {key}={value}: a fine-tune of a fine-tuned model "
                f"goes on training its adapter, so it keeps its {', '.join(PARENT_LORA)}. Leave {key} out.",
                param=f"hyperparameters.{key}", code="conflicts_with_parent_model",
            )
    return requested | parent.lora


def _file(organization: Organization, file_id: str, param: str, model: BaseModel, method: str | None = None) -> File:
    """The organization's file, within the model's context, and (given ``method``) in the format it trains on."""
    file = File.objects.for_org(organization).filter(pk=file_id).first()
    if file is None:
        raise not_found("file", file_id, param=param)
    if file.purpose != FINE_TUNE_PURPOSE:
        raise ApiError(
            f"File {file_id} was uploaded with purpose '{file.purpose}'; training reads files uploaded with purpose "
            f"'{FINE_TUNE_PURPOSE}'.", param=param, code="invalid_file_purpose",
        )
    if method is not None and file.format != METHOD_FORMAT[method]:
        needed = METHOD_FORMAT[method]
        other = next(m for m in METHODS if METHOD_FORMAT[m] == file.format)
        raise ApiError(
            f"File {file_id} holds {file.format} lines ({FORMAT_SHAPES[file.format]}); the {method} method trains on "
            f"{needed} lines ({FORMAT_SHAPES[needed]}). Give a {needed} file, or method {{\"type\": \"{other}\"}}.",
            param=param, code="invalid_file_format",
        )
    if file.max_example_tokens > model.engine.max_model_len:
        raise ApiError(
            f"File {file_id} has an example of {file.max_example_tokens} tokens; {model.id} takes at most "
            f"{model.engine.max_model_len}.", param=param, code="invalid_file",
        )
    return file


def chosen_suffix(requested: str | None) -> str:
    if requested is None:
        return "ft-" + secrets.token_hex(4)  # the platform names it; the unique constraint still guards
    if not is_valid_suffix(requested):
        raise ApiError(
            "suffix may hold only letters, digits, '-' and '_', at most 64 characters", param="suffix", code="invalid_suffix"
        )
    return requested


def resolve_hyperparameters(requested: dict, examples: int, model: BaseModel, method: str = SUPERVISED) -> dict:
    """Turn every "auto" into a number, so the job records exactly what it will train with. ``examples``
    counts a DPO job's pairs, which its batches and epochs are made of."""
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
        )
    target_modules = requested.get("target_modules") or list(TARGET_MODULES)
    unknown = sorted(set(target_modules) - set(TARGET_MODULES))
    if unknown:
        raise ApiError(
            f"target_modules has unknown modules {unknown}; choose from {list(TARGET_MODULES)}",
            param="hyperparameters.target_modules", code="invalid_hyperparameter",
        )
    if method == REINFORCEMENT:
        return _reinforcement_hyperparameters(requested, examples, n_epochs, multiplier, lora_r, model)
    resolved = {
        "n_epochs": n_epochs,
        "batch_size": batch_size,
        "learning_rate_multiplier": multiplier,
        "lora_r": lora_r,
        "lora_alpha": requested.get("lora_alpha", 2 * lora_r),
        "lora_dropout": requested.get("lora_dropout", 0.05),
        "target_modules": target_modules,
        # Once an epoch each, at its end, unless asked for more (workers.training.config).
        "n_evals": 1 if requested.get("n_evals", AUTO) == AUTO else requested["n_evals"],
        "n_checkpoints": 1 if requested.get("n_checkpoints", AUTO) == AUTO else requested["n_checkpoints"],
        "early_stopping": requested.get("early_stopping"),  # {"patience", "min_delta", "metric"}, or None: off
    }
    if method == DPO:
        beta = requested.get("beta", AUTO)
        resolved["beta"] = DPO_BETA_AUTO if beta == AUTO else float(beta)
    return resolved


def _reinforcement_hyperparameters(
    requested: dict, examples: int, n_epochs: int, multiplier: float, lora_r: int, model: BaseModel
) -> dict:
    """A reinforcement job's: OpenAI's, every "auto" resolved, and the adapter's rank."""
    unknown = sorted(set(requested) - set(REINFORCEMENT_KEYS))
    if unknown:
        raise ApiError(
            f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a reinforcement hyperparameter; "
            f"it takes {', '.join(REINFORCEMENT_KEYS)}", param=f"hyperparameters.{unknown[0]}", code="invalid_hyperparameter",
        )
    effort = requested.get("reasoning_effort", "default")
    if effort != "default":
        raise ApiError(
            f"reasoning_effort={effort!r}: {model.id} does not reason before it answers, so it has no effort to set. "
            "Leave reasoning_effort out (or \"default\").", param="hyperparameters.reasoning_effort", code="invalid_hyperparameter",
        )
    batch_size = requested.get("batch_size", AUTO)
    batch_size = min(8, max(1, examples // 8)) if batch_size == AUTO else batch_size
    compute = requested.get("compute_multiplier", AUTO)
    compute = 1.0 if compute == AUTO else float(compute)
    eval_interval = requested.get("eval_interval", AUTO)
    if eval_interval == AUTO:  # about 4 evaluations (the validation prompts' reward, and a checkpoint) in the job
        eval_interval = -(-n_epochs * -(-examples // batch_size) // 4)
    early_stopping = requested.get("early_stopping")
    return {
        "n_epochs": n_epochs,
        "batch_size": batch_size,
        "learning_rate_multiplier": multiplier,
        "compute_multiplier": compute,
        "samples_per_prompt": min(MAX_SAMPLES_PER_PROMPT, max(2, round(SAMPLES_PER_PROMPT * compute))),
        "eval_interval": eval_interval,
        "eval_samples": 1 if requested.get("eval_samples", AUTO) == AUTO else requested["eval_samples"],
        "reasoning_effort": "default",
        "lora_r": lora_r,
        "lora_alpha": LORA_ALPHA,  # the training loop's (``workers.training_loop``)
        "max_completion_tokens": requested.get("max_completion_tokens", MAX_COMPLETION_TOKENS_AUTO),
        "early_stopping": None if early_stopping is None else {**early_stopping, "metric": "reward"},
    }


def _check_early_stopping(hyperparameters: dict, validation: File | None, evaluation: dict | None) -> None:
    """Early stopping watches the validation loss (a job without validation examples has none) or the
    evaluation graders' score of each checkpoint (a job without an evaluation has no graders)."""
    early_stopping = hyperparameters["early_stopping"]
    if early_stopping is None:
        return
    if early_stopping["metric"] == "eval_score" and evaluation is None:
        raise ApiError(
            "early_stopping by eval_score scores each checkpoint with the job's evaluation graders: give evaluation "
            "({\"graders\": [...], \"file\": <held-out examples>}) too.",
            param="hyperparameters.early_stopping.metric", code="early_stopping_needs_evaluation",
        )
    if early_stopping["metric"] == "valid_loss" and validation is None:
        raise ApiError(
            "early_stopping watches the validation loss: give a validation_file too (or metric eval_score).",
            param="hyperparameters.early_stopping", code="early_stopping_needs_validation",
        )


def _check_queued_cap(organization: Organization) -> None:
    cap = settings.CONFIG.limits.queued_jobs_per_organization
    if FineTuningJob.objects.for_org(organization).filter(status=JobStatus.QUEUED).count() >= cap:
        raise ApiError(
            f"{organization.name} already has {cap} queued fine-tuning jobs, its limit "
            f"({LIMIT_SETTINGS['queued_jobs_per_organization']}); create more once some have started.",
            status=429, type=RATE_LIMIT_TYPE, code="too_many_queued_jobs",
        )


def create_job(organization: Organization, user: User | None, request: JobRequest) -> FineTuningJob:
    _check_queued_cap(organization)  # a soft cap: two requests at once may both pass it
    start = starting_point(organization, request.model)
    model = start.base
    training = _file(organization, request.training_file, "training_file", model, request.method)
    validation = (
        _file(organization, request.validation_file, "validation_file", model, request.method) if request.validation_file else None
    )
    suffix = chosen_suffix(request.suffix)
    requested = request.hyperparameters
    parent = start.parent
    if parent is not None:
        requested = _keep_parent_lora(requested, parent)
    hyperparameters = resolve_hyperparameters(requested, training.example_count, model, request.method)
    grader = None
    if request.method == REINFORCEMENT:
        grader = _reinforcement_grader(organization, request, parent)
        _check_answer_fits(hyperparameters["max_completion_tokens"], [f for f in (training, validation) if f], model)
    evaluation = _evaluation(organization, request.evaluation, validation, model)
    if request.method != REINFORCEMENT:  # a reinforcement job's early stopping watches its reward
        _check_early_stopping(hyperparameters, validation, evaluation)
    revision = _revision_to_publish(parent.model if parent else None, ModelName(model.id, suffix))
    try:
        with transaction.atomic():
            job = FineTuningJob.objects.create(
                organization=organization, created_by=user, model=model.id,
                parent_model=parent.name if parent else None, parent_revision=parent.revision if parent else None,
                training_file=training.id, method=request.method, grader=grader,
                validation_file=validation.id if validation else None, suffix=suffix, revision=revision,
                seed=request.seed if request.seed is not None else secrets.randbelow(2**31),
                hyperparameters=hyperparameters, metadata=request.metadata, evaluation=evaluation, status=JobStatus.QUEUED,
                queued_at=timezone.now(),
            )
            what = {DPO: "preference pairs", REINFORCEMENT: "prompts"}.get(request.method, "examples")
            record_event(job, f"Validated training file: {training.example_count} {what}, {training.token_count} tokens")
            record_event(job, f"Job queued; {training_turns.jobs_ahead_phrase(job)}")
            # Only after the commit can a worker see the job; a rolled-back job is never sent.
            transaction.on_commit(lambda: _send_or_503(job))
    except IntegrityError:
        raise suffix_taken(str(ModelName(model.id, suffix))) from None
    return job


def _reinforcement_grader(organization: Organization, request: JobRequest, parent: Parent | None) -> dict:
    """The grader that scores each sample, checked as OpenAI's fine-tuning graders are (each judge a
    model the caller may use). A reinforcement job starts from a base model, and its graders score it
    at every evaluation: it takes no parent and no publish gate."""
    if parent is not None:
        raise ApiError(
            f"{parent.name} is a fine-tuned model: reinforcement fine-tuning starts from a base model here. "
            f"Give model={parent.exact.split(':')[0]!r}.", param="model", code="invalid_model",
        )
    if request.evaluation is not None:
        raise ApiError(
            "A reinforcement job is scored by its grader on the validation prompts every eval_interval steps, and "
            "publishes its best step: leave evaluation out.", param="evaluation", code="invalid_evaluation",
        )
    return _checked_openai_grader(organization, request.grader, "method.reinforcement.grader")


def _check_answer_fits(max_completion_tokens: int, files: list[File], model: BaseModel) -> None:
    """Each prompt and the longest answer sampled for it fit the model's context."""
    for file in files:
        if file.max_example_tokens + max_completion_tokens > model.engine.max_model_len:
            raise ApiError(
                f"File {file.id} has a prompt of {file.max_example_tokens} tokens, and with max_completion_tokens="
                f"{max_completion_tokens} its answers could take {file.max_example_tokens + max_completion_tokens}; "
                f"{model.id} takes at most {model.engine.max_model_len}. Lower max_completion_tokens or shorten the prompts.",
                param="hyperparameters.max_completion_tokens", code="invalid_hyperparameter",
            )


def _evaluation(organization: Organization, requested: dict | None, validation: File | None, model: BaseModel) -> dict | None:
    """The evaluation as the job keeps it: its file resolved (the validation file by default), its
    graders checked (the platform's: a pattern that does not compile, a schema too large or pointing
    elsewhere; OpenAI's: as ``core.graders.spec`` checks them, each judge a model the caller may use)."""
    if requested is None:
        return None
    graders = [_checked_grader(organization, index, grader) for index, grader in enumerate(requested["graders"])]
    problem = first_own_problem(graders)  # checked in a separate process, with limits (core.grading)
    if problem is not None:
        index, field, message = problem
        param = f"evaluation.graders[{index}].{field}"
        raise ApiError(f"{param}: {message}", param=param, code="invalid_grader")
    requested = {**requested, "graders": graders}
    file_id = requested.get("file")
    if file_id is None:
        if validation is None:
            raise ApiError(
                "An evaluation needs held-out examples: give evaluation.file, or a validation_file to evaluate on.",
                param="evaluation.file", code="evaluation_needs_a_file",
            )
        file_id = validation.id
    else:
        _file(organization, file_id, "evaluation.file", model)
    return {**requested, "file": file_id}


def _checked_grader(organization: Organization, index: int, grader: dict) -> dict:
    """OpenAI's graders checked here (the platform's were by the serializer): their fields, and their judges."""
    if grader["type"] in GRADERS:
        return grader
    return _checked_openai_grader(organization, grader, f"evaluation.graders[{index}]")


def _checked_openai_grader(organization: Organization, grader: object, param: str) -> dict:
    """One of OpenAI's graders, its fields checked (``core.graders.spec``) and each judge a model the caller may use."""
    checked = checked_grader(grader, param)
    for where, judge in judge_models(checked):
        if registry.resolve_model(organization, judge) is None:
            raise model_not_found(judge, f"{param}.{where}")  # the same answer as for a model that does not exist
    return checked


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


def _send_or_503(job: FineTuningJob) -> None:
    try:
        training_turns.send_to_trainer(job.id)
    except OperationalError as exc:  # the broker is down; the job stays queued for the sweeper
        log.warning("job %s is queued but could not be sent to a trainer: %s", job.id, exc)
        record_event(
            job, "The job could not be sent to a trainer (the broker is unreachable); it is sent again once the broker is back",
            level="warn",
        )
        raise ApiError(
            f"Job {job.id} was created and is queued, but the task broker is unreachable, so no trainer has been told yet. "
            "It starts by itself once the broker is back; do not create it again.",
            status=503, code="broker_unavailable",
        ) from None
