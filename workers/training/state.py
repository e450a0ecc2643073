"""What a run keeps beside each checkpoint's adapter so that another worker can go on from there.

A job whose worker dies is queued again; with this state the new run continues after the last
checkpoint (at an epoch's end, or within an epoch when a job asks for several an epoch) and ends
with the very adapter an unbroken run would have made: the optimizer's moments, the learning-rate
schedule, the shuffling generator, the dropout generator and early stopping's record all come back
as they were.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftModel, set_peft_model_state_dict
from safetensors.torch import load_file

from workers.training.early_stopping import BestValidation

TRAINING_STATE_FILE = "training_state.pt"


@dataclass(frozen=True)
class Progress:
    epoch: int  # the last finished epoch
    step: int
    trained_tokens: int
    train_loss: float | None  # that step's, for a run that resumes with nothing left to train
    epoch_steps: int = 0  # steps of the next epoch already done: a checkpoint within an epoch


def save_training_state(
    checkpoint_dir: Path,
    progress: Progress,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    shuffle_state: torch.Tensor,
    best: BestValidation | None,
) -> None:
    """``shuffle_state``: the shuffling generator's state before it drew the order of epoch
    ``progress.epoch + 1`` (a resume draws the same order again, and skips the steps done)."""
    state = {
        "epoch": progress.epoch,
        "step": progress.step,
        "trained_tokens": progress.trained_tokens,
        "train_loss": progress.train_loss,
        "epoch_steps": progress.epoch_steps,
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "shuffler": shuffle_state,
        "dropout_rng": torch.get_rng_state(),
        "best": best.state() if best is not None else None,
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
    best: BestValidation | None,
) -> Progress:
    """Put the checkpoint's adapter weights and training state back (``best``'s record too, when the
    run stops early); return where the run was."""
    state = torch.load(checkpoint_dir / TRAINING_STATE_FILE, weights_only=True)
    set_peft_model_state_dict(model, load_file(checkpoint_dir / "adapter_model.safetensors"))
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    shuffler.set_state(state["shuffler"])
    torch.set_rng_state(state["dropout_rng"])
    if best is not None and state.get("best") is not None:
        best.restore(state["best"])
    # A checkpoint written before checkpoints within an epoch existed has no "epoch_steps": it ended an epoch.
    return Progress(state["epoch"], state["step"], state["trained_tokens"], state["train_loss"], state.get("epoch_steps", 0))
