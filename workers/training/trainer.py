"""The training loop: seed, model, data, train, save. It reads top to bottom on purpose.

``train()`` is all the job runner calls. It reports through ``TrainingCallbacks`` (progress,
checkpoints, cancellation) and knows nothing about jobs, databases or queues. ``train()`` is the
loop; each of its steps is a small function below it, in the order the loop calls them.

One loop for both methods: a supervised run's items are chat examples and its loss the replies'
cross-entropy; a DPO run's (``config.method == "dpo"``) are preference pairs and its loss DPO's
(``preference.py``). Only what an item is and how a step's loss is computed differ; checkpoints,
resuming, evaluations, early stopping and reports are the same code.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

import torch
from peft import PeftModel
from transformers import PreTrainedTokenizerBase

from core.chat_tokens import load_tokenizer
from core.datasets import PreferencePair, Record
from workers.training.config import EVAL_SCORE, TrainingConfig
from workers.training.data import Example, PackedRow, TokenizedExample, pack, target_log_probs, tokenize_example, truncate
from workers.training.early_stopping import BestValidation, put_back, trainable_weights
from workers.training.model import load_model_with_lora, save_adapter
from workers.training.preference import TokenizedPair, preference_backward, preference_validation, tokenize_pair
from workers.training.preference_loss import PreferenceTally
from workers.training.state import Progress, restore_training_state, save_training_state

DPO = "dpo"  # TrainingConfig.method of a preference run
Item = TokenizedExample | TokenizedPair  # what a run trains on: all one or all the other (``_tokenized``)


@dataclass(frozen=True)
class StepMetrics:
    step: int  # optimizer steps done, from 1
    total_steps: int
    epoch: int  # from 1
    ends_epoch: bool  # the epoch's last step
    train_loss: float  # this step's loss: the mean over its examples of each one's mean token loss
    valid_loss: float | None  # None unless validation ran at this step
    tokens_per_second: float  # training tokens per second since the previous report (validation excluded)
    trained_tokens: int  # cumulative: every token of every example seen, epochs counted
    elapsed_s: float  # since train() started, loading included
    resumed_at_step: int = 0  # the step a resumed run started after: elapsed_s covers the steps since
    # DPO only (None otherwise): the step's pairs' mean reward margin, beta * ((pi_c - ref_c) - (pi_r - ref_r)),
    # and the share of them whose margin is positive (preference_loss.py).
    reward_margin: float | None = None
    preference_accuracy: float | None = None


@dataclass(frozen=True)
class TrainingResult:
    adapter_dir: Path | None  # None when cancelled
    trained_tokens: int  # every step's that ran (early stopping: none of the steps it skipped)
    steps: int
    final_train_loss: float | None  # the result's step's; None when no step ran
    final_valid_loss: float | None
    cancelled: bool
    # Early stopping: the step whose adapter is the result (the best validation loss or checkpoint
    # score), and whether the patience ran out before the last step. None and False without it.
    best_step: int | None = None
    stopped_early: bool = False
    best_score: float | None = None  # early stopping by EVAL_SCORE: the best checkpoint's score


class TrainingDiverged(Exception):
    """The loss stopped being a number: training further cannot recover, and nothing is worth saving."""

    def __init__(self, step: int, loss: float, which: str = "training") -> None:
        super().__init__(f"the {which} loss became {loss} at step {step}")
        self.step, self.loss, self.which = step, loss, which


class TrainingCallbacks(Protocol):
    def on_step(self, metrics: StepMetrics) -> None: ...

    def on_checkpoint(self, epoch: int, step: int, adapter_dir: Path, metrics: StepMetrics) -> float | None:
        """Keep the checkpoint; with early stopping by EVAL_SCORE, return its score (None: not scored)."""
        ...

    def should_stop(self) -> bool: ...


@dataclass(frozen=True)
class StepLoss:
    loss: float  # the step's mean loss (supervised: over its examples; DPO: over its pairs)
    preference: PreferenceTally | None = None  # DPO: the step's pairs, for their margin and accuracy


@dataclass(frozen=True)
class _Optimization:
    """What a run carries from step to step besides the adapter's weights: a checkpoint keeps all three."""

    optimizer: torch.optim.Optimizer  # AdamW on the adapter only
    schedule: torch.optim.lr_scheduler.LRScheduler  # linear warm-up, then linear decay to zero at the last step
    shuffler: torch.Generator  # each epoch's order of the examples: a generator of our own, so a resume can restore it


@dataclass
class _ThroughputWindow:
    """Training tokens and the seconds their steps took, since the previous report (validation excluded)."""

    tokens: int = 0
    seconds: float = 0.0

    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def train(
    config: TrainingConfig,
    train_examples: Sequence[Record],
    validation_examples: Sequence[Record] | None,
    output_dir: Path,
    callbacks: TrainingCallbacks,
    resume_from: Path | None = None,
    resume_score: float | None = None,
) -> TrainingResult:
    """Train a LoRA adapter on the chat examples (or, for DPO, the preference pairs); return where the
    final adapter is.

    Writes ``output_dir/checkpoints/epoch-<n>/`` after each full epoch, ``checkpoints/step-<n>/``
    for those within an epoch (``checkpoints_per_epoch`` > 1; a run cut short by max_steps or early
    stopping gets none for the steps after its last scheduled one) and ``output_dir/adapter/`` at the
    end: the last step's adapter, or with early stopping the best evaluation's. Each is a complete
    PEFT adapter folder when it appears, with the training state (``state.py``) beside it in a
    checkpoint. Cancelled runs leave their checkpoints but no final adapter.

    ``resume_from``: such a checkpoint of an earlier run of the same job (same config, examples and
    seed); training goes on after its step and ends as the unbroken run would have. With early
    stopping by EVAL_SCORE, ``resume_score`` is that checkpoint's score (its state was saved before it
    was scored).
    """
    started = time.perf_counter()
    output_dir = Path(output_dir)
    if not train_examples:
        raise ValueError("no training examples")
    _seed_and_threads(config)

    # Model and data: the adapter starts from the seed; the examples are tokenized once.
    tokenizer = load_tokenizer(config.base_model_path)  # as the upload check loads it, so counts agree
    model = load_model_with_lora(config)
    train_set = _tokenized(tokenizer, train_examples, config)
    valid_set = _validation_sample(tokenizer, validation_examples or [], config)
    steps_per_epoch = math.ceil(len(train_set) / config.batch_size)
    total_steps = _count_steps(len(train_set), config)
    report_every = max(config.log_every_steps, math.ceil(total_steps / config.max_step_reports))
    evals_at = _spread(steps_per_epoch, config.evals_per_epoch)  # steps within an epoch, from 1
    checkpoints_at = _spread(steps_per_epoch, config.checkpoints_per_epoch)
    optimization = _build_optimization(model, config, total_steps)
    by_score = config.early_stopping_metric == EVAL_SCORE  # else by the validation loss, which needs examples
    best = _early_stopping(config) if valid_set or by_score else None

    # Train, from the start or from where an earlier run's checkpoint left off.
    done = _resume(resume_from, model, optimization, best)
    if best is not None and by_score and resume_score is not None:
        best.record(done.step, resume_score, done.train_loss or 0.0, lambda: trainable_weights(model))
    step, trained_tokens, train_loss = done.step, done.trained_tokens, done.train_loss
    valid_loss: float | None = None
    window = _ThroughputWindow()
    for epoch in range(done.epoch + 1, config.n_epochs + 1):
        # The shuffler before it draws this epoch's order (a checkpoint within the epoch keeps it), and the
        # steps of the epoch a resume within it skips.
        epoch_order = optimization.shuffler.get_state()
        steps_done = done.epoch_steps if epoch == done.epoch + 1 else 0
        batches = _epoch_batches(train_set, config.batch_size, optimization.shuffler)
        for epoch_step, (batch, epoch_done) in enumerate(batches, start=1):
            if step == total_steps or (best is not None and best.exhausted):
                break
            if epoch_step <= steps_done:
                continue
            if callbacks.should_stop():
                return TrainingResult(None, trained_tokens, step, train_loss, valid_loss, cancelled=True)

            step_started = time.perf_counter()
            step_loss = _optimization_step(model, optimization, batch, config)
            train_loss = step_loss.loss
            step += 1
            if not math.isfinite(train_loss):
                raise TrainingDiverged(step, train_loss)
            batch_tokens = sum(_n_tokens(item) for item in batch)
            trained_tokens += batch_tokens
            window.tokens += batch_tokens
            window.seconds += time.perf_counter() - step_started

            step_valid_loss: float | None = None
            if valid_set and (epoch_step in evals_at or step == total_steps or _every(step, config.eval_every_steps)):
                step_valid_loss = valid_loss = _evaluate(model, valid_set, config, step)
                if best is not None and not by_score:
                    best.record(step, step_valid_loss, train_loss, lambda: trainable_weights(model))

            metrics = StepMetrics(
                step=step,
                total_steps=total_steps,
                epoch=epoch,
                ends_epoch=epoch_done,
                train_loss=train_loss,
                valid_loss=step_valid_loss,
                tokens_per_second=window.tokens_per_second(),
                trained_tokens=trained_tokens,
                elapsed_s=time.perf_counter() - started,
                resumed_at_step=done.step,
                reward_margin=step_loss.preference.reward_margin() if step_loss.preference else None,
                preference_accuracy=step_loss.preference.accuracy() if step_loss.preference else None,
            )
            if _every(step, report_every) or step_valid_loss is not None or step == total_steps:
                callbacks.on_step(metrics)
                window = _ThroughputWindow()
            if epoch_step in checkpoints_at:
                if epoch_done:
                    progress = Progress(epoch, step, trained_tokens, train_loss)
                    order = optimization.shuffler.get_state()  # the next epoch draws from here
                else:
                    progress = Progress(epoch - 1, step, trained_tokens, train_loss, epoch_steps=epoch_step)
                    order = epoch_order
                checkpoint = _save_checkpoint(model, optimization, progress, order, best, output_dir)
                score = callbacks.on_checkpoint(epoch, step, checkpoint, metrics)
                if best is not None and by_score and score is not None:
                    # After the checkpoint's state was saved: a resume from it records it (``resume_score``).
                    best.record(step, score, train_loss, lambda: trainable_weights(model))

    # Save: unless cancelled while the last step ran, the final adapter is the result: the last
    # step's, or with early stopping the best evaluation's.
    if callbacks.should_stop():
        return TrainingResult(None, trained_tokens, step, train_loss, valid_loss, cancelled=True)
    if best is not None and best.step is not None:
        put_back(model, best.weights)
        adapter_dir = save_adapter(model, output_dir / "adapter")
        return TrainingResult(
            adapter_dir, trained_tokens, step, best.train_loss, None if by_score else best.loss, cancelled=False,
            best_step=best.step, stopped_early=step < total_steps, best_score=best.best_value if by_score else None,
        )
    adapter_dir = save_adapter(model, output_dir / "adapter")
    return TrainingResult(adapter_dir, trained_tokens, step, train_loss, valid_loss, cancelled=False)


def _seed_and_threads(config: TrainingConfig) -> None:
    """The same seed gives the same adapter (on the same thread count): LoRA init, dropout, shuffling."""
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)


def _validation_sample(
    tokenizer: PreTrainedTokenizerBase, examples: Sequence[Record], config: TrainingConfig
) -> list[TokenizedExample] | list[TokenizedPair]:
    """At most ``max_valid_examples`` of them, always the same ones for a seed, each with a reply to score."""
    if len(examples) > config.max_valid_examples:
        examples = random.Random(config.seed).sample(list(examples), config.max_valid_examples)
    tokenized = _tokenized(tokenizer, examples, config)
    if config.method == DPO:
        return [pair for pair in cast(list[TokenizedPair], tokenized) if pair.scored]
    return [e for e in cast(list[TokenizedExample], tokenized) if e.n_trained > 0]


def _tokenized(
    tokenizer: PreTrainedTokenizerBase, examples: Sequence[Record], config: TrainingConfig
) -> list[TokenizedExample] | list[TokenizedPair]:
    """Chat examples for a supervised run, pairs for DPO (the job runner checked the file's format)."""
    if config.method == DPO:
        return [tokenize_pair(tokenizer, cast(PreferencePair, e), config.max_seq_len) for e in examples]
    return [truncate(tokenize_example(tokenizer, cast(Example, e)), config.max_seq_len) for e in examples]


def _n_tokens(item: Item) -> int:
    """Tokens fed for an item (a pair: both conversations): what ``trained_tokens`` counts."""
    return item.n_tokens if isinstance(item, TokenizedPair) else len(item.input_ids)


def _count_steps(n_examples: int, config: TrainingConfig) -> int:
    steps_per_epoch = math.ceil(n_examples / config.batch_size)
    total_steps = config.n_epochs * steps_per_epoch
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    return total_steps


def _spread(steps_per_epoch: int, per_epoch: int) -> set[int]:
    """``per_epoch`` steps of an epoch, from 1, evenly spaced and the last one its end (each step at most once)."""
    return {math.ceil(k * steps_per_epoch / per_epoch) for k in range(1, per_epoch + 1)}


def _early_stopping(config: TrainingConfig) -> BestValidation | None:
    if config.early_stopping_patience is None:
        return None
    maximize = config.early_stopping_metric == EVAL_SCORE
    return BestValidation(config.early_stopping_patience, config.early_stopping_min_delta, maximize)


def _build_optimization(model: PeftModel, config: TrainingConfig, total_steps: int) -> _Optimization:
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, config.warmup_steps, total_steps))
    return _Optimization(optimizer, schedule, shuffler=torch.Generator().manual_seed(config.seed))


def _resume(
    checkpoint_dir: Path | None, model: PeftModel, optimization: _Optimization, best: BestValidation | None
) -> Progress:
    """Where training starts: nothing done, or an earlier run's checkpoint put back into the model,
    the optimizer and early stopping's record."""
    if checkpoint_dir is None:
        return Progress(epoch=0, step=0, trained_tokens=0, train_loss=None)
    return restore_training_state(
        checkpoint_dir, model, optimization.optimizer, optimization.schedule, optimization.shuffler, best
    )


def _epoch_batches(
    train_set: Sequence[Item], batch_size: int, shuffler: torch.Generator
) -> Iterator[tuple[list[Item], bool]]:
    """One epoch's batches in a fresh shuffled order, each with whether it is the epoch's last."""
    order = torch.randperm(len(train_set), generator=shuffler).tolist()
    for first in range(0, len(order), batch_size):
        yield [train_set[i] for i in order[first : first + batch_size]], first + batch_size >= len(order)


def _optimization_step(
    model: PeftModel, optimization: _Optimization, batch: list[Item], config: TrainingConfig
) -> StepLoss:
    """One optimizer step over one batch, row by row: the rows' gradients add up to the batch's. Returns its loss."""
    model.train()
    optimization.optimizer.zero_grad(set_to_none=True)
    if config.method == DPO:
        tally = preference_backward(model, cast(list[TokenizedPair], batch), config.beta, config.max_row_tokens)
        step_loss = StepLoss(tally.mean_loss(), tally)
    else:
        step_loss = StepLoss(_supervised_backward(model, cast(list[TokenizedExample], batch), config))
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], config.max_grad_norm)
    optimization.optimizer.step()
    optimization.schedule.step()
    return step_loss


def _supervised_backward(model: PeftModel, batch: list[TokenizedExample], config: TrainingConfig) -> float:
    """Forward and backward over the batch's rows; returns its loss (the mean of its examples' mean token loss)."""
    total = 0.0
    for row in pack(batch, config.max_row_tokens):
        if len(row.targets) == 0:
            continue  # nothing to learn in this row (every reply in it has weight 0)
        loss = row_loss(model, row)
        loss.backward()
        total += loss.item()
    return total


def row_loss(model: torch.nn.Module, row: PackedRow) -> torch.Tensor:
    """The row's share of its batch's loss: its targets' cross-entropies, weighted."""
    return (-target_log_probs(model, row) * row.weights).sum()


def _evaluate(
    model: PeftModel, valid_set: list[TokenizedExample] | list[TokenizedPair], config: TrainingConfig, step: int
) -> float:
    """The validation loss after ``step``; one that stopped being a number ends the run."""
    loss = _validation_loss(model, valid_set, config)
    if not math.isfinite(loss):
        raise TrainingDiverged(step, loss, "validation")
    return loss


@torch.no_grad()
def _validation_loss(
    model: PeftModel, valid_set: list[TokenizedExample] | list[TokenizedPair], config: TrainingConfig
) -> float:
    """Mean over the validation examples of each one's mean token loss (the train loss's definition);
    for DPO, the mean DPO loss of the validation pairs."""
    if config.method == DPO:
        return preference_validation(model, cast(list[TokenizedPair], valid_set), config.beta, config.max_row_tokens).mean_loss()
    valid_set = cast(list[TokenizedExample], valid_set)
    model.eval()  # no dropout
    total = sum(row_loss(model, row).item() for row in pack(valid_set, config.max_row_tokens) if len(row.targets))
    model.train()
    return total


def _save_checkpoint(
    model: PeftModel,
    optimization: _Optimization,
    progress: Progress,
    shuffle_state: torch.Tensor,
    best: BestValidation | None,
    output_dir: Path,
) -> Path:
    """The adapter as it is now, and beside it what a resumed run needs to go on from there. An
    epoch's end keeps its name of old (``epoch-<n>``); a checkpoint within an epoch is ``step-<n>``."""
    name = f"step-{progress.step}" if progress.epoch_steps else f"epoch-{progress.epoch}"
    checkpoint = save_adapter(model, output_dir / "checkpoints" / name)
    save_training_state(checkpoint, progress, optimization.optimizer, optimization.schedule, shuffle_state, best)
    return checkpoint


def _lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def _every(step: int, interval: int | None) -> bool:
    if not interval:
        return False
    return step % interval == 0
