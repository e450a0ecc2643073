"""A worker's own view of its environment, returned through the broker by ``workers.tasks``."""

from __future__ import annotations

import socket

from django.conf import settings

from health.checks import database


def report() -> dict:
    db = database()
    return {
        "hostname": socket.gethostname(),
        "database": {"ok": db.ok, "detail": db.detail},
        "models_with_weights": [
            model.id for model in settings.MODEL_CATALOG.models if (model.weights / "config.json").is_file()
        ],
    }
