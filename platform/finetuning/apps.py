from django.apps import AppConfig


class FinetuningConfig(AppConfig):
    name = "finetuning"
