from django.apps import AppConfig


class EvalsConfig(AppConfig):
    name = "evals"
