# The project's Celery app is created (and made the default) whenever Django's project is loaded,
# so every process (web, workers, management commands) has it before any task is sent.
from base.celery import app as celery_app

__all__ = ["celery_app"]
