"""What a run keeps beside each epoch's adapter so that another worker can go on from there.

A job whose worker dies is queued again; with this state the new run continues after the last
finished epoch and ends with the very adapter an unbroken run would have made: the optimizer's
moments, the learning-rate schedule, the shuffling generator and the dropout generator all come
back as they were.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel, set_peft_model_state_dict
from safetensors.torch import load_file

TRAINING_STATE_FILE = "training_state.pt"


@dataclass(frozen=True)
class Progress:
    epoch: int  # the last finished epoch
    step: int
    trained_tokens: int
    train_loss: float | None  # that step's, for a run that resumes with nothing left to train


def save_training_state(
    checkpoint_dir: Path,
    progress: Progress,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    shuffler: torch.Generator,
) -> None:
    state = {
        "epoch": progress.epoch,
        "step": progress.step,
        "trained_tokens": progress.trained_tokens,
        "train_loss": progress.train_loss,
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "shuffler": shuffler.get_state(),
        "dropout_rng": torch.get_rng_state(),
    }
    staging = checkpoint_dir / f".{TRAINING_STATE_FILE}.partial"
    torch.save(state, staging)
    os.replace(staging, checkpoint_dir / TRAINING_STATE_FILE)  # a reader sees all of it or none


def restore_training_state(
    checkpoint_dir: Path,
    model: PeftModel,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    shuffler: torch.Generator,
) -> Progress:
    """Put the checkpoint's adapter weights and training state back; return where the run was."""
    state = torch.load(checkpoint_dir / TRAINING_STATE_FILE, weights_only=True)
    set_peft_model_state_dict(model, load_file(checkpoint_dir / "adapter_model.safetensors"))
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    shuffler.set_state(state["shuffler"])
    torch.set_rng_state(state["dropout_rng"])
    return Progress(state["epoch"], state["step"], state["trained_tokens"], state["train_loss"])
