"""The dashboard's Batches page: the organization's batches with their status and progress, and their
files (input, output, errors) to download. Batches are created through the API (``client.batches``)."""

from __future__ import annotations

from django.core.paginator import Paginator
from django.http import Http404, HttpResponse
from django.shortcuts import get_object_or_404, render

from base.streaming import StreamedFileResponse
from batches.models import Batch
from dashboard.organizations import OrganizationRequest, with_organization
from finetuning import files
from finetuning.models import File

BATCHES_PER_PAGE = 50
LIVE_REFRESH_SECONDS = 5  # while a batch on the page is unfinished, the page looks again this often
FILE_KINDS = ("input", "output", "error")


@with_organization
def batch_list(request: OrganizationRequest) -> HttpResponse:
    page = Paginator(Batch.objects.for_org(request.organization), BATCHES_PER_PAGE).get_page(request.GET.get("page"))
    live = any(not batch.is_finished for batch in page)
    return render(
        request,
        "dashboard/batches.html",
        {"page": page, "live_refresh_seconds": LIVE_REFRESH_SECONDS if live else None},
    )


@with_organization
def batch_file(request: OrganizationRequest, batch_id: str, kind: str) -> StreamedFileResponse:
    """A batch's input, output or error file, streamed from the store (another organization's: 404)."""
    batch = get_object_or_404(Batch.objects.for_org(request.organization), pk=batch_id)
    file_id = {"input": batch.input_file_id, "output": batch.output_file_id, "error": batch.error_file_id}.get(kind)
    if file_id is None:
        raise Http404(f"This batch has no {kind} file.")
    file = get_object_or_404(File.objects.for_org(request.organization), pk=file_id)
    content = files.open_content(file)
    return StreamedFileResponse(
        content, as_attachment=True, filename=file.filename, content_type=files.content_type(file)
    )
