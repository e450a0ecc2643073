"""Early stopping: which evaluation was best, and when to stop waiting for a better one. An evaluation
is the validation loss (lower is better) or, with ``maximize``, the job's graders' score of a
checkpoint's answers (higher is better: ``workers.evaluation.checkpoint_score``).

The trainer records every evaluation here; a new best keeps a copy of the adapter's weights at that
step, which becomes the run's result however many steps follow it. The record goes into every
checkpoint's training state (``state.py``), so a resumed run stops and publishes as the unbroken one would.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

Weights = dict[str, torch.Tensor]


@dataclass
class BestValidation:
    patience: int  # evaluations in a row without an improvement that stop the run
    min_delta: float  # an improvement is a value better than the best by more than this
    maximize: bool = False  # a score (higher is better), not a loss
    step: int | None = None  # the best evaluation's step; None before the first
    loss: float = math.inf  # the best value so far: a loss, or with ``maximize`` the score negated
    train_loss: float | None = None  # that step's training loss
    evals_since: int = 0  # evaluations since the best one that did not improve on it
    weights: Weights = field(default_factory=dict, repr=False)  # the trainable weights at the best step

    def record(self, step: int, value: float, train_loss: float, weights: Callable[[], Weights]) -> bool:
        """Count one evaluation (a loss, or with ``maximize`` a score); True when it is the new best
        (``weights`` is called only then)."""
        loss = -value if self.maximize else value  # kept as a loss: the checkpoints' state reads the same
        if loss < self.loss - self.min_delta:
            self.step, self.loss, self.train_loss, self.evals_since = step, loss, train_loss, 0
            self.weights = weights()
            return True
        self.evals_since += 1
        return False

    @property
    def best_value(self) -> float:
        """The best evaluation's loss, or its score."""
        return -self.loss if self.maximize else self.loss

    @property
    def exhausted(self) -> bool:
        """The patience has run out: training stops."""
        return self.step is not None and self.evals_since >= self.patience

    def state(self) -> dict:
        """What a checkpoint keeps of it (the settings come from the job's config again)."""
        return {
            "step": self.step, "loss": self.loss, "train_loss": self.train_loss,
            "evals_since": self.evals_since, "weights": self.weights,
        }

    def restore(self, state: dict) -> None:
        self.step, self.loss, self.train_loss = state["step"], state["loss"], state["train_loss"]
        self.evals_since, self.weights = state["evals_since"], state["weights"]


def trainable_weights(model: torch.nn.Module) -> Weights:
    """A copy of the adapter's weights as they are now (what ``put_back`` restores)."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def put_back(model: torch.nn.Module, weights: Weights) -> None:
    for name, parameter in model.named_parameters():
        if name in weights:
            parameter.copy_(weights[name])
