"""Training files: checked line by line, then stored; nothing is kept from a file that fails, or
from one over the organization's upload rate or storage quota (``finetuning.quotas``).

An upload arrives on disk (Django spools any file over FILE_UPLOAD_MAX_MEMORY_SIZE to a temporary
file, after ``server.body_limits`` capped the body) and is read from there a line at a time, twice:
to check it, then to store it. The web process never holds a whole file in memory."""

from __future__ import annotations

from typing import BinaryIO, NamedTuple, cast

from django.conf import settings
from django.contrib.auth.models import User
from django.core.files.uploadedfile import UploadedFile
from django.db import transaction
from django.db.models import Q

from accounts.models import Organization
from core.api_errors import ApiError, human_size
from core.batch_input import BatchFile, check_batch_file
from core.config import UPLOAD_LIMIT_SETTING
from core.datasets import CHAT, Dataset, Example, Record, as_chat, parse_dataset
from core.eval_items import EvalFile, check_eval_file
from core.request_limits import estimated_prompt_tokens
from finetuning import quotas, results, storage
from finetuning.models import FINISHED_STATUSES, File, FineTuningJob
from finetuning.tokens import default_model, token_counter

PURPOSE = "fine-tune"
BATCH_PURPOSE = "batch"  # request lines for the Batch API (``core.batch_input``)
EVALS_PURPOSE = "evals"  # an eval run's items, {"item": {...}} lines (``core.eval_items``)
UPLOAD_PURPOSES = (PURPOSE, BATCH_PURPOSE, EVALS_PURPOSE)
ITEMS_FORMAT = "items"  # an evals file's format, beside core.datasets' chat and preference


def check_dataset(source: bytes | BinaryIO, keep_examples: bool = True) -> tuple[Dataset, list[int]]:
    """Parse and check every line; return the dataset and each conversation's token count (a
    preference pair's two, input with each answer, one after the other)."""
    model = default_model()
    count = token_counter(model)
    counts: list[int] = []

    def counted(example: Example) -> int:
        counts.append(count(example))
        return counts[-1]

    dataset = parse_dataset(
        source, settings.CONFIG.min_training_examples, counted, model.engine.max_model_len, keep_examples=keep_examples
    )
    return dataset, counts


def dataset_error(dataset: Dataset) -> ApiError:
    problems = [str(error) for error in dataset.errors]
    summary = dataset.problem or f"{len(problems)} line(s) have problems"
    message = "Invalid training file: " + "; ".join([summary, *problems] if problems else [summary])
    return ApiError(message, param="file", code="invalid_file", errors=[vars(e) for e in dataset.errors])


def line_problems_error(checked: BatchFile | EvalFile) -> ApiError:
    """A batch file's or an evals file's line problems, as a dataset's are reported."""
    kind = "batch" if isinstance(checked, BatchFile) else "evals"
    problems = [str(error) for error in checked.errors]
    summary = checked.problem or f"{len(problems)} line(s) have problems"
    message = f"Invalid {kind} file: " + "; ".join([summary, *problems] if problems else [summary])
    return ApiError(message, param="file", code="invalid_file", errors=[vars(e) for e in checked.errors])


class _Counted(NamedTuple):
    examples: int  # or a batch's requests
    tokens: int
    longest: int  # the longest example's tokens
    format: str  # a dataset's (core.datasets: chat or preference lines)


def _counts(source: BinaryIO, purpose: str) -> _Counted:
    """What an upload that passes its purpose's check holds; the check's 400 otherwise. A batch's
    lines are not tokenized: their prompts are estimated as the rate limits estimate them (what the
    batch queue limit counts, ``batches.creation``), and its requests are counted when they run."""
    if purpose == BATCH_PURPOSE:
        checked = check_batch_file(source, lambda line: estimated_prompt_tokens(line.body, line.url.removeprefix("/v1/")))
        if not checked.ok:
            raise line_problems_error(checked)
        return _Counted(checked.request_count, checked.prompt_tokens, 0, CHAT)
    if purpose == EVALS_PURPOSE:
        items = check_eval_file(source)
        if not items.ok:
            raise line_problems_error(items)
        return _Counted(items.item_count, 0, 0, ITEMS_FORMAT)
    dataset, counts = check_dataset(source, keep_examples=False)
    if not dataset.ok:
        raise dataset_error(dataset)
    return _Counted(dataset.example_count, sum(counts), max(counts), dataset.format)


def upload_file(organization: Organization, user: User | None, upload: UploadedFile, purpose: str) -> File:
    if purpose not in UPLOAD_PURPOSES:
        known = "' or '".join(UPLOAD_PURPOSES)
        raise ApiError(f"purpose must be '{known}', not '{purpose}'", param="purpose", code="invalid_purpose")
    assert upload.size is not None  # Django sizes every file it receives (None only for a File made by hand)
    if upload.size > settings.CONFIG.max_upload_bytes:
        raise upload_too_large(upload.size)  # before reading it into memory
    quotas.charge_upload(organization)
    upload.seek(0)
    counted = _counts(cast(BinaryIO, upload.file), purpose)
    size = upload.size
    quotas.check_storage(organization, size)  # before anything is stored
    file = File(
        organization=organization, created_by=user, filename=(upload.name or "upload.jsonl")[:255], purpose=purpose, bytes=size,
        example_count=counted.examples, token_count=counted.tokens, max_example_tokens=counted.longest,
        format=counted.format,
    )
    file.storage_key = f"files/{organization.pk}/{file.id}.jsonl"
    # Bytes first, row second: a crash between leaves an orphan object, never a row without data.
    upload.seek(0)
    storage.files().put_stream(file.storage_key, cast(BinaryIO, upload.file))  # a received file's bytes
    try:
        with transaction.atomic():
            # Again, under the organization's lock (held only this long, not while the bytes are
            # written): another upload may have taken the quota meanwhile.
            quotas.check_storage(organization, size, locked=True)
            file.save()
    except ApiError:
        storage.files().delete_prefix(file.storage_key)
        raise
    return file


def upload_too_large(size: int) -> ApiError:
    limit = settings.CONFIG.max_upload_bytes
    return ApiError(
        f"The file is {human_size(size)}; the limit is {human_size(limit)} ({UPLOAD_LIMIT_SETTING}).",
        status=413, param="file", code="file_too_large",
    )


def content_type(file: File) -> str:
    return "text/csv" if file.purpose == results.PURPOSE else "application/jsonl"


def open_content(file: File) -> BinaryIO:
    """The stored bytes, to read a block or a line at a time; the caller closes it."""
    return storage.files().open(file.storage_key)


def load_examples(file: File) -> list[Record]:
    """Every example, as the trainer takes them: chat examples, or a preference file's pairs."""
    with open_content(file) as stream:
        return parse_dataset(stream, min_examples=1).examples


def first_examples(file: File, count: int) -> list[Example]:
    """The file's first ``count`` examples as chat examples (a preference pair's preferred conversation),
    read from its start and no further (the dataset page's preview and an eval's examples: the totals
    are the ones counted at upload, on the row)."""
    with open_content(file) as stream:
        max_tokens = default_model().engine.max_model_len  # a line longer than any example is skipped unread
        records = parse_dataset(stream, min_examples=1, max_tokens=max_tokens, stop_after=count).examples
    return [as_chat(record) for record in records]


def delete_file(file: File) -> None:
    unfinished = FineTuningJob.objects.exclude(status__in=FINISHED_STATUSES)
    busy = unfinished.filter(Q(training_file=file.id) | Q(validation_file=file.id)).first()
    if busy:
        raise ApiError(f"File {file.id} is used by fine-tuning job {busy.id}, which has not finished.", status=409, code="file_in_use")
    file.delete()
    storage.files().delete_prefix(file.storage_key)
