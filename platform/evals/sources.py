"""The items an eval's runs score, from where OpenAI's evals take them, at most MAX_ITEMS a run:
- ``file_content``: the items in the run's request, ``[{"item": {...}, "sample"?: {...}}]``;
- ``file_id``: a file of purpose ``evals`` (the same entries, one a line, checked at upload), or
  (ours) a fine-tuning chat file, whose examples that end with an assistant's answer are the items
  ``{"input": <the messages before it>, "expected": <its content>}`` (``CHAT_ITEM_SCHEMA``).
Every item is checked against the eval's ``item_schema`` when the run is created, in the grading
sandbox's process (the schema is the tenant's: ``core.grading``)."""

from __future__ import annotations

from typing import Any

from accounts.models import Organization
from core.api_errors import ApiError, not_found
from core.eval_items import EvalItem, chat_items, parsed_entry, read_items
from core.eval_prompts import DEFAULT_INPUT
from core.grading import first_invalid_item
from evals.models import Eval, EvalRun
from finetuning.files import EVALS_PURPOSE, PURPOSE, first_examples, open_content
from finetuning.models import File

MAX_ITEMS = 500  # items scored per run (on two cores, about a minute per hundred short answers)

# The item of a chat file's example: what ``{{item.input}}`` and ``{{item.expected}}`` name.
CHAT_ITEM_SCHEMA = {
    "type": "object",
    "properties": {
        "input": {"type": "array", "items": {"type": "object", "properties": {"role": {"type": "string"}, "content": {"type": "string"}}}},
        "expected": {"type": "string"},
    },
    "required": ["input", "expected"],
}


def item_schema(evaluation: Eval) -> dict:
    return evaluation.item_schema if evaluation.item_schema is not None else CHAT_ITEM_SCHEMA


def file_items(organization: Organization | None, file_id: str, param: str) -> list[EvalItem]:
    """The first MAX_ITEMS items of a file: the organization's (None: the run's worker, which reads
    the file its run was created with); a 404 for another's or a deleted one, a 400 for a file of
    another purpose or a chat file with no example ending in an answer."""
    files = File.objects.all() if organization is None else File.objects.for_org(organization)
    file = files.filter(pk=file_id).first()
    if file is None:
        raise not_found("file", file_id, param=param)
    if file.purpose == EVALS_PURPOSE:
        with open_content(file) as stream:
            return read_items(stream, MAX_ITEMS)
    if file.purpose != PURPOSE:
        raise ApiError(
            f"File {file_id} has purpose '{file.purpose}'; an eval reads files of purpose '{EVALS_PURPOSE}' "
            f"({{\"item\": {{...}}}} lines) or '{PURPOSE}' (chat examples).", param=param, code="invalid_file_purpose",
        )
    items = chat_items(first_examples(file, MAX_ITEMS), MAX_ITEMS)
    if not items:
        raise ApiError(
            f"File {file_id} has no example ending with an assistant message, the expected answer its graders "
            "compare with: give each example a last message {\"role\": \"assistant\", \"content\": <expected answer>}.",
            param=param, code="invalid_file",
        )
    return items


def content_items(content: list[Any], param: str) -> list[EvalItem]:
    """A run's ``file_content``, each entry checked; a 400 naming the first bad one."""
    if not content:
        raise ApiError(f"{param}: give at least one item", param=param, code="invalid_value")
    if len(content) > MAX_ITEMS:
        raise ApiError(
            f"{param} has {len(content):,} items; a run scores at most {MAX_ITEMS}. Split them into several runs, or "
            f"upload them as a file of purpose '{EVALS_PURPOSE}' (a run scores its first {MAX_ITEMS}).",
            param=param, code="too_many_items",
        )
    items = []
    for index, entry in enumerate(content):
        item, problem = parsed_entry(entry)
        if item is None:
            raise ApiError(f"{param}.{index}: {problem}", param=f"{param}.{index}", code="invalid_item")
        items.append(item)
    return items


def check_items(evaluation: Eval, items: list[EvalItem], param: str, in_file: bool = False) -> None:
    """Every item valid against the eval's item schema, or a 400 naming the first that is not: by
    its path in ``file_content``, or (``in_file``) by its place in the file."""
    invalid = first_invalid_item(item_schema(evaluation), [item.item for item in items])
    if invalid is None:
        return
    index, path, message = invalid
    if in_file:
        where, what = param, f"{param}: item {index + 1} of the file" + (f", at {path}" if path else "")
    else:
        where = what = f"{param}.{index}.item" + (f".{path}" if path else "")
    raise ApiError(f"{what}: {message} (the eval's data_source_config.item_schema)", param=where, code="invalid_item")


def run_items(run: EvalRun) -> list[EvalItem]:
    """The items a run scores, read again when it starts: its own ``file_content``, or its file (a
    file deleted since the run was created is a 404 naming it)."""
    source = run.data_source.get("source") or {"type": "file_id", "id": run.file_id}  # a run from before data sources
    if source["type"] == "file_content":
        return [EvalItem(entry["item"], entry.get("sample")) for entry in source["content"]]
    try:
        return file_items(None, source["id"], "data_source.source.id")
    except ApiError as exc:
        if exc.status == 404:
            raise ApiError(f"File {source['id']} was deleted after the run was created.", status=404, code="file_not_found") from None
        raise


def input_messages(run: EvalRun) -> dict | None:
    """How the run makes each item's prompt; None for a jsonl run (no model answers)."""
    if run.data_source.get("type") == "jsonl":
        return None
    return run.data_source.get("input_messages") or DEFAULT_INPUT
