"""The upload caps as a person reads them, wherever a file over its cap is refused: next to a
dashboard form's file field before anything is sent (``dashboard.forms``), and on the page the
body-size cap answers when the file was sent all the same (``server.body_limits``). One sentence
for each, so both say the same."""

from __future__ import annotations

from django.conf import settings

from core.api_errors import human_size
from core.config import ADAPTER_UPLOAD_LIMIT_SETTING, UPLOAD_LIMIT_SETTING


def file_too_large_message() -> str:
    """A dataset over the upload cap."""
    limit = human_size(settings.CONFIG.max_upload_bytes)
    return f"This file is larger than {limit}, the most a dataset may be ({UPLOAD_LIMIT_SETTING})."


def adapter_too_large_message() -> str:
    """An adapter archive over its cap."""
    limit = human_size(settings.CONFIG.max_adapter_upload_bytes)
    return f"This archive is larger than {limit}, the most an adapter may be ({ADAPTER_UPLOAD_LIMIT_SETTING})."
