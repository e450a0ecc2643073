"""The Celery app, configured from Django settings (names prefixed CELERY_ there)."""

import os
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
for entry in (str(_ROOT), str(_ROOT / "platform")):
    if entry not in sys.path:
        sys.path.insert(0, entry)
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "server.settings")

from celery import Celery  # noqa: E402  (sys.path must hold platform/ first)

app = Celery("fineserve")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["workers"])
