"""What a training run needs to know: one dataclass, every default explained."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


VALID_LOSS, EVAL_SCORE = "valid_loss", "eval_score"  # what early stopping watches


@dataclass
class TrainingConfig:
    base_model_path: Path  # the base model's Hugging Face folder: config, weights, tokenizer, chat template
    base_model_id: str  # its public id, written as base_model_name_or_path in adapter_config.json (vLLM checks it)

    # The OpenAI hyperparameters (the caller resolves "auto" and the learning-rate multiplier).
    n_epochs: int = 3
    batch_size: int = 8  # examples per optimizer step
    learning_rate: float = 2e-4  # peak rate: linear warm-up to it, then linear decay to 0 at the last step

    # The adapter. Rank 8 on every linear projection is the usual quality/size sweet spot for small models.
    lora_r: int = 8
    lora_alpha: int = 16  # updates are scaled by alpha / r
    lora_dropout: float = 0.05
    # None: every linear projection of the decoder layers (PEFT's "all-linear", which leaves lm_head out:
    # it is tied to the embeddings here, and vLLM serves adapters of the layers only).
    target_modules: list[str] | None = None

    # A continued fine-tune: the parent's PEFT adapter folder, trained further instead of a fresh adapter
    # (its rank, alpha and target modules win over the fields above; lora_dropout is this run's).
    init_adapter: Path | None = None

    # What is learned: "supervised" (chat examples: the replies' cross-entropy) or "dpo" (preference pairs:
    # the DPO loss, preference_loss.py, against a reference that is the model the run starts from).
    method: str = "supervised"
    beta: float = 0.1  # DPO: how far the policy may move from the reference (higher: closer)
    # DPO's reference when it is not the base model: a continued fine-tune's parent adapter, loaded beside
    # the trained one (a resumed run needs it although it does not start from it). None: the base model,
    # the trained adapter switched off.
    reference_adapter: Path | None = None

    seed: int = 42  # the LoRA initialisation, dropout and the shuffling all follow from it
    max_seq_len: int = 2048  # a longer example is cut to this (uploads are checked against the context first)
    log_every_steps: int = 1  # on_step cadence; epoch ends and the last step are always reported
    # ...but at most about this many reports in all: a 10,000-step run's events stay few enough to list
    # and plot at once (the cadence widens to ceil(total_steps / max_step_reports)).
    max_step_reports: int = 500
    max_steps: int | None = None  # stop after this many optimizer steps (tests and benchmarks cap runs)

    warmup_steps: int = 0  # linear warm-up; fine-tunes are short, and LoRA starts as a no-op (B = 0)
    weight_decay: float = 0.0  # LoRA matrices are small and start at zero: decay only slows them
    max_grad_norm: float = 1.0  # clip: one odd batch must not wreck a short run
    # Validation loss is computed at every epoch end and at the last step, on at most this many validation
    # examples (a fixed sample): on a CPU a large validation file would otherwise cost more than training.
    max_valid_examples: int = 128
    eval_every_steps: int | None = None  # also validate every this many steps (None: epoch ends only)
    # The API's n_evals and n_checkpoints: this many validations and checkpoints in each epoch, evenly
    # spaced, the last at its end (more than the epoch has steps: every step). One each is an epoch-end one.
    evals_per_epoch: int = 1
    checkpoints_per_epoch: int = 1
    # Early stopping: training stops once this many evaluations in a row have not improved on the best
    # by more than early_stopping_min_delta, and the adapter of the best evaluation is the result
    # (early_stopping.py). None: off, and the last step's adapter is the result. The evaluations are the
    # validation loss's (VALID_LOSS), or the scores the callbacks give each checkpoint (EVAL_SCORE).
    early_stopping_patience: int | None = None
    early_stopping_min_delta: float = 0.0
    early_stopping_metric: str = VALID_LOSS

    # Speed. A step's examples are packed into rows of at most this many tokens, one forward/backward pass
    # per row, gradients summed. Attention stays per example whatever the row length, so this only trades
    # activation memory (it grows with the row) against the number of passes. A longer example gets a row alone.
    max_row_tokens: int = 2048
    num_threads: int | None = None  # torch CPU threads; None leaves torch's default (one per core)
