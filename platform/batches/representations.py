"""The Batch API's object, in OpenAI's shape (``openai.types.Batch``)."""

from __future__ import annotations

from base.records import unix
from batches.models import Batch


def batch_object(batch: Batch) -> dict:
    usage = batch.usage or {}
    input_tokens, output_tokens = usage.get("input_tokens", 0), usage.get("output_tokens", 0)
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": unix(batch.created_at),
        "in_progress_at": unix(batch.in_progress_at),
        "expires_at": unix(batch.expires_at),
        "finalizing_at": unix(batch.finalizing_at),
        "completed_at": unix(batch.completed_at),
        "failed_at": unix(batch.failed_at),
        "expired_at": unix(batch.expired_at),
        "cancelling_at": unix(batch.cancelling_at),
        "cancelled_at": unix(batch.cancelled_at),
        "request_counts": {"total": batch.total, "completed": batch.completed, "failed": batch.failed},
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        },
        "metadata": batch.metadata,
    }
