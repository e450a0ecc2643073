"""Celery workers: ``celery -A workers worker -Q default,training``."""

from workers.celery_app import app

__all__ = ["app"]
