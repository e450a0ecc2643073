"""LoRA training for the platform: pure torch + PEFT, no Django.

The job runner calls ``train()`` with a ``TrainingConfig``, the examples and its callbacks; uploads
are checked with ``example_token_count()``, which counts tokens exactly as ``train()`` feeds them.
"""

from workers.training.config import TrainingConfig
from workers.training.data import example_token_count
from workers.training.trainer import StepMetrics, TrainingCallbacks, TrainingDiverged, TrainingResult, train

__all__ = ["StepMetrics", "TrainingCallbacks", "TrainingConfig", "TrainingDiverged", "TrainingResult", "example_token_count", "train"]
