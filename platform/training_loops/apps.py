from django.apps import AppConfig


class TrainingLoopsConfig(AppConfig):
    name = "training_loops"
