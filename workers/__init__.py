"""Celery workers: ``celery -A workers worker --queues default,training``.

The app is the Django project's (``base/celery.py``, which ``server/__init__.py`` loads with the
project); this package puts the project on the path for the ``celery`` command and holds the tasks,
the job runner and the training code.
"""

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
for _entry in (str(_ROOT), str(_ROOT / "platform")):
    if _entry not in sys.path:
        sys.path.insert(0, _entry)

from base.celery import app  # noqa: E402  (platform/ must be on the path first)

__all__ = ["app"]
