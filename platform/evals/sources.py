"""The examples an eval's runs score: a file of the organization's, in the fine-tuning chat format
(``{"prompt", "completion"}`` lines too); each example's last assistant message is the expected
answer and the messages before it the prompt (``core.evaluation.cases_of``). At most MAX_ITEMS a run."""

from __future__ import annotations

from accounts.models import Organization
from core.api_errors import ApiError, not_found
from core.evaluation import Case, cases_of
from finetuning.files import first_examples
from finetuning.models import File

MAX_ITEMS = 500  # examples scored per run (on two cores, about a minute per hundred short answers)


def usable_file(organization: Organization, file_id: str, param: str) -> int:
    """How many examples of the organization's file a run would score; a 404 for a file that is not
    its own, a 400 for one with no example ending in an assistant's answer."""
    file = File.objects.for_org(organization).filter(pk=file_id).first()
    if file is None:
        raise not_found("file", file_id, param=param)
    count = len(cases_of(first_examples(file, MAX_ITEMS), MAX_ITEMS))
    if count == 0:
        raise ApiError(
            f"File {file_id} has no example ending with an assistant message, the expected answer its graders "
            "compare with: give each example a last message {\"role\": \"assistant\", \"content\": <expected answer>}.",
            param=param, code="invalid_file",
        )  # fmt: skip
    return count


def cases_in(file_id: str) -> list[Case]:
    """The cases a run scores; a file deleted since the run was created is a 404 naming it."""
    file = File.objects.filter(pk=file_id).first()
    if file is None:
        raise ApiError(f"File {file_id} was deleted after the run was created.", status=404, code="file_not_found")
    return cases_of(first_examples(file, MAX_ITEMS), MAX_ITEMS)
