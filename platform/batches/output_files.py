"""A finished batch's files (purpose "batch_output", read with ``client.files.content``): the output
file, a line per request answered 200, and the error file, a line per request refused or failed,
both in the input file's line order. Written from the result rows a block at a time (never the whole
file in memory), bytes first and the row last, under ids made from the batch's own: a worker that
dies while writing them writes the same files again, and a file whose row exists is complete."""

from __future__ import annotations

import tempfile
from typing import BinaryIO, cast

from batches.models import Batch, BatchResult
from finetuning import storage
from finetuning.models import File

PURPOSE = "batch_output"
_SPOOL_BYTES = 4 * 1024 * 1024  # kept in memory up to this, then on disk
_READ_BLOCK = 500  # result rows read from the database at a time


def file_id(batch: Batch, kind: str) -> str:
    """``kind`` "output" or "error": the file's id, the same every time for one batch."""
    return f"file-{batch.pk.removeprefix('batch_')}{kind[0]}"


def write_files(batch: Batch) -> tuple[str | None, str | None]:
    """(output_file_id, error_file_id); None for a file that would be empty, as OpenAI's are."""
    return _write(batch, "output", True), _write(batch, "error", False)


def _write(batch: Batch, kind: str, ok: bool) -> str | None:
    ident = file_id(batch, kind)
    if File.objects.filter(pk=ident).exists():
        return ident  # written by an earlier attempt, bytes and all
    rows = BatchResult.objects.filter(batch=batch, ok=ok).order_by("line").values_list("record", flat=True)
    if not rows.exists():
        return None
    key = f"files/{batch.organization_id}/{ident}.jsonl"
    with tempfile.SpooledTemporaryFile(max_size=_SPOOL_BYTES) as spool:
        count = 0
        for record in rows.iterator(chunk_size=_READ_BLOCK):
            spool.write(record.encode() + b"\n")
            count += 1
        size = spool.tell()
        spool.seek(0)
        storage.files().put_stream(key, cast(BinaryIO, spool))
    File.objects.create(
        id=ident, organization_id=batch.organization_id, created_by=batch.created_by, filename=f"{batch.pk}_{kind}.jsonl",
        purpose=PURPOSE, bytes=size, storage_key=key, example_count=count, token_count=0, max_example_tokens=0,
    )
    return ident
