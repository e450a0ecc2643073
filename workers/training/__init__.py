"""LoRA training for the platform: pure torch + PEFT, no Django.

The job runner calls ``train()`` with a ``TrainingConfig``, the examples and its callbacks. Uploads are
counted with ``example_token_count()`` from ``core.chat_tokens`` (torch-free, for the web process),
the tokenizing ``train()`` feeds; it is exported here too.
"""

from workers.training.config import TrainingConfig
from workers.training.data import example_token_count
from workers.training.trainer import StepMetrics, TrainingCallbacks, TrainingDiverged, TrainingResult, train

__all__ = [
    "StepMetrics", "TrainingCallbacks", "TrainingConfig", "TrainingDiverged", "TrainingResult", "example_token_count", "train",
]
