"""Reinforcement fine-tuning: a GRPO-style loop on the training loop's model (``loop_model.LoopModel``),
sampling through the serving pool. It reads top to bottom on purpose.

Each step takes a batch of prompts and, for each one, a group of answers sampled from the weights as
they are now (published to the dynamic LoRA path and answered by the pool, with each token's id and
log-probability). The job's grader scores every answer; within a group, each answer's advantage is
its reward minus the group's mean, over the group's spread (an answer is better or worse than its
siblings, whatever the prompt's difficulty). The update is Tinker's ``importance_sampling`` loss over
the answers' tokens, each token's advantage lessened by a KL term to the base model, so the policy
earns its reward without drifting into text the base would never write. A group whose answers all
scored alike teaches nothing and is left out.

Every ``eval_interval`` steps (and before the first, and at the last) the validation prompts are
answered and scored the same way: the validation reward, on the job's chart beside the training
reward, and a checkpoint. The published adapter is the best evaluation's; with early stopping,
training ends once the reward has not improved for ``patience`` evaluations.

No Django, no queues: the job runner (``workers.run_job``) gives the pool's side as a ``Policy``.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from core.chat_tokens import load_tokenizer, render
from core.datasets import PromptItem
from workers.training.early_stopping import BestValidation, put_back, trainable_weights
from workers.training.trainer import TrainingDiverged, TrainingResult
from workers.training_loop.loop_model import AdamStep, LoopModel, LoraShape, LossInput
from workers.training_loop.losses import ADVANTAGES, SAMPLING_LOGPROBS, TARGET_TOKENS

LOSS = "importance_sampling"
MAX_VALID_PROMPTS = 64  # validation prompts answered at an evaluation, at most (a fixed sample)


@dataclass(frozen=True)
class ReinforcementConfig:
    base_model_path: Path
    base_model_id: str  # written as base_model_name_or_path in the adapter's config (vLLM checks it)
    lora_r: int = 8
    seed: int = 42
    n_epochs: int = 1
    batch_size: int = 4  # prompts per step
    samples_per_prompt: int = 4  # a group: the answers whose rewards are compared
    learning_rate: float = 2e-4
    eval_interval: int = 4  # steps between evaluations
    eval_samples: int = 1  # answers per validation prompt at an evaluation
    max_completion_tokens: int = 256
    temperature: float = 1.0  # sampling: the exploration the rewards choose among
    # The KL term's weight: each token's advantage is lessened by kl_coef * (log p_policy - log p_base).
    # Small: with rewards normalised per group, it keeps drift in check without drowning the signal.
    kl_coef: float = 0.02
    early_stopping_patience: int | None = None  # None: train to the end (the best evaluation is still the result)
    early_stopping_min_delta: float = 0.0
    max_steps: int | None = None  # tests and benchmarks cap runs
    max_grad_norm: float = 1.0


@dataclass(frozen=True)
class Answer:
    """One sampled answer: its tokens and each one's log-probability under the weights that sampled it."""

    text: str
    tokens: list[int]
    logprobs: list[float]


@dataclass(frozen=True)
class Grade:
    reward: float
    passed: bool  # scored the grader's full marks (or passed its threshold, where it has one)


class Policy(Protocol):
    """The serving pool's side of the loop."""

    base_model: str  # the name that answers with the base model: the fresh adapter is a no-op

    def serve(self, step: int, adapter_dir: Path) -> str:
        """Publish the adapter as it is after ``step``; the name the pool answers with it under."""
        ...

    def sample(self, model: str, prompts: list[list[int]], n: int, max_tokens: int, temperature: float, seed: int) -> list[list[Answer]]:
        """``n`` answers to each prompt (token ids), by ``model``."""
        ...

    def grade(self, items: list[dict], answers: list[str]) -> list[Grade]:
        """Each answer's reward by the job's grader, the answer to its item's prompt."""
        ...


@dataclass(frozen=True)
class RewardStep:
    step: int  # from 1
    total_steps: int
    epoch: int
    ends_epoch: bool
    reward_mean: float  # the step's answers'
    reward_std: float
    pass_rate: float
    kl: float  # mean over the answers' tokens of log p_policy - log p_base
    answer_tokens: float  # mean tokens an answer
    samples_per_second: float  # answers sampled, scored and trained on, per second of the step
    trained_tokens: int  # cumulative: prompts and answers fed to the trainer
    elapsed_s: float
    valid_reward: float | None = None  # at an evaluation
    valid_pass_rate: float | None = None
    resumed_at_step: int = 0  # a reinforcement job starts over when resumed
    # Where the step's time went: "serve" (publishing the weights), "sample", "grade", "train".
    seconds: dict[str, float] = field(default_factory=dict)


class ReinforcementCallbacks(Protocol):
    def on_step(self, metrics: RewardStep) -> None: ...

    def on_evaluation(self, total_steps: int, valid_reward: float, valid_pass_rate: float) -> None:
        """The validation reward before the first step (the base model's)."""
        ...

    def on_checkpoint(self, epoch: int, step: int, adapter_dir: Path, metrics: RewardStep) -> object: ...

    def should_stop(self) -> bool: ...


@dataclass(frozen=True)
class _Prompt:
    item: dict
    tokens: list[int]


@dataclass
class _Served:
    """Which weights the pool answers with under which name: published again only once they changed."""

    name: str
    step: int = 0


class _Clock:
    """Seconds by phase of a step: a slow step's event says what was slow."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = round(self.seconds.get(phase, 0.0) + time.perf_counter() - started, 3)


@dataclass
class _Tally:
    rewards: list[float] = field(default_factory=list)
    passed: list[bool] = field(default_factory=list)

    def add(self, grades: Sequence[Grade]) -> None:
        self.rewards += [grade.reward for grade in grades]
        self.passed += [grade.passed for grade in grades]

    @property
    def mean(self) -> float:
        return float(np.mean(self.rewards)) if self.rewards else 0.0

    @property
    def pass_rate(self) -> float:
        return float(np.mean(self.passed)) if self.passed else 0.0


def train_by_reward(
    config: ReinforcementConfig,
    prompts: Sequence[PromptItem],
    validation: Sequence[PromptItem],
    output_dir: Path,
    policy: Policy,
    callbacks: ReinforcementCallbacks,
) -> TrainingResult:
    """Train a LoRA adapter on ``prompts`` by the grader's rewards; the best evaluation's adapter is the
    result (``output_dir/adapter``)."""
    started = time.perf_counter()
    if not prompts:
        raise ValueError("no training prompts")
    random.seed(config.seed)
    torch.manual_seed(config.seed)

    # Model and data: a fresh adapter (a no-op: the base model answers the first step), prompts rendered once.
    tokenizer = load_tokenizer(config.base_model_path)
    model = LoopModel(str(config.base_model_path), config.base_model_id, LoraShape(config.lora_r, config.seed))
    train_set = [_prompt(tokenizer, item) for item in prompts]
    held_out = random.Random(config.seed).sample(list(validation), min(len(validation), MAX_VALID_PROMPTS))
    valid_set = [_prompt(tokenizer, item) for item in held_out]
    steps_per_epoch = math.ceil(len(train_set) / config.batch_size)
    total_steps = config.n_epochs * steps_per_epoch
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    adam = AdamStep(learning_rate=config.learning_rate, beta1=0.9, beta2=0.999, eps=1e-8, grad_clip_norm=config.max_grad_norm)
    patience = config.early_stopping_patience or total_steps + 1  # without early stopping, never exhausted
    best = BestValidation(patience, config.early_stopping_min_delta, maximize=True)
    served = _Served(policy.base_model)
    shuffler = random.Random(config.seed)

    # The base model's validation reward: where the chart starts, and what the result must beat.
    if valid_set:
        tally = _evaluate(config, policy, served.name, valid_set)
        callbacks.on_evaluation(total_steps, tally.mean, tally.pass_rate)
        best.record(0, tally.mean, 0.0, lambda: trainable_weights(model.peft_model))

    step, trained_tokens, window = 0, 0, _Tally()
    for epoch in range(1, config.n_epochs + 1):
        order = list(range(len(train_set)))
        shuffler.shuffle(order)
        for start in range(0, len(order), config.batch_size):
            if step == total_steps or best.exhausted:
                break
            if callbacks.should_stop():
                return TrainingResult(None, trained_tokens, step, None, None, cancelled=True)
            step_started, clock = time.perf_counter(), _Clock()
            batch = [train_set[i] for i in order[start : start + config.batch_size]]
            with clock("serve"):
                name = _served_name(model, policy, served, step, output_dir)
            with clock("sample"):
                groups = policy.sample(name, [p.tokens for p in batch], config.samples_per_prompt,
                                       config.max_completion_tokens, config.temperature, config.seed + step)
            with clock("grade"):
                grades = policy.grade([p.item for p, group in zip(batch, groups) for _ in group],
                                      [answer.text for group in groups for answer in group])
            tally = _Tally()
            tally.add(grades)
            window.add(grades)
            with clock("train"):
                tokens, loss, kl = _update(model, config, batch, groups, [g.reward for g in grades])
                model.optim_step(adam)
            step += 1
            if not math.isfinite(loss):
                raise TrainingDiverged(step, loss)
            answers = [answer for group in groups for answer in group]
            trained_tokens += tokens
            metrics = RewardStep(
                step=step, total_steps=total_steps, epoch=epoch, ends_epoch=start + config.batch_size >= len(order),
                reward_mean=tally.mean, reward_std=float(np.std(tally.rewards)), pass_rate=tally.pass_rate, kl=kl,
                answer_tokens=float(np.mean([len(a.tokens) for a in answers])) if answers else 0.0,
                samples_per_second=len(answers) / (time.perf_counter() - step_started),
                trained_tokens=trained_tokens, elapsed_s=time.perf_counter() - started, seconds=clock.seconds,
            )
            if step % config.eval_interval == 0 or step == total_steps:
                metrics = _evaluation_step(model, config, policy, served, valid_set, window, metrics, best, output_dir)
                callbacks.on_checkpoint(epoch, step, model.save_adapter(output_dir / "checkpoint"), metrics)
                window = _Tally()
            callbacks.on_step(metrics)

    if callbacks.should_stop():
        return TrainingResult(None, trained_tokens, step, None, None, cancelled=True)
    if best.step is not None and best.step != step:
        put_back(model.peft_model, best.weights)
    adapter_dir = model.save_adapter(output_dir / "adapter")
    return TrainingResult(
        adapter_dir, trained_tokens, step, None, None, cancelled=False, best_step=best.step,
        stopped_early=step < total_steps, best_score=best.best_value if best.step is not None else None,
    )


def _prompt(tokenizer: PreTrainedTokenizerBase, item: PromptItem) -> _Prompt:
    """The prompt's tokens as the pool's chat endpoint makes them: the template's rendering, up to the
    assistant's turn, tokenized without special tokens of the tokenizer's own (the template writes them)."""
    text = render(tokenizer, item.prompt, item.prompt.tools, add_generation_prompt=True)
    return _Prompt(item.item, tokenizer(text, add_special_tokens=False)["input_ids"])


def _served_name(model: LoopModel, policy: Policy, served: _Served, step: int, output_dir: Path) -> str:
    """The name the pool answers with the weights of ``step`` under, published if they are not yet."""
    if step != served.step:
        served.name = policy.serve(step, model.save_adapter(output_dir / "serving"))
        served.step = step
    return served.name


def _update(
    model: LoopModel, config: ReinforcementConfig, batch: list[_Prompt], groups: list[list[Answer]], rewards: list[float]
) -> tuple[int, float, float]:
    """Add the step's policy gradient to the adapter's (``optim_step`` applies it). The tokens trained
    on, the loss, and the mean KL to the base over the answers' tokens."""
    n_answers = sum(len(group) for group in groups)
    learned = [(prompt, answer, advantage)
               for (prompt, answer), advantage in zip(((p, a) for p, group in zip(batch, groups) for a in group), _advantages(groups, rewards))
               if advantage != 0.0 and answer.tokens]  # a group that scored alike teaches nothing
    if not learned:
        return 0, 0.0, 0.0
    data = [_datum(prompt.tokens, answer) for prompt, answer, _ in learned]
    # The KL term: how much likelier the policy makes each answer token than the base does (the
    # sampler's logprob is the policy's: these weights sampled it), taken off the token's advantage.
    # Each answer's tokens share its weight (1 / its length), so the loss is the mean over answers.
    drift_sum, drift_tokens = 0.0, 0
    for datum, base, (prompt, answer, advantage) in zip(data, model.base_logprobs(data, LOSS), learned):
        first = len(prompt.tokens) - 1  # the target of this position is the answer's first token
        drift = datum.inputs[SAMPLING_LOGPROBS][first:] - base[first:]
        datum.inputs[ADVANTAGES][first:] = (advantage - config.kl_coef * drift) / (len(answer.tokens) * n_answers)
        drift_sum, drift_tokens = drift_sum + float(drift.sum()), drift_tokens + len(drift)
    done = model.forward_backward(data, LOSS)
    return sum(len(datum.tokens) for datum in data), done.metrics.get("loss:sum", 0.0), drift_sum / drift_tokens


def _advantages(groups: list[list[Answer]], rewards: list[float]) -> list[float]:
    """Each answer's reward against its group's: (r - mean) / std, 0 for a group that scored alike."""
    found: list[float] = []
    position = 0
    for group in groups:
        scores = np.asarray(rewards[position : position + len(group)], dtype=np.float64)
        position += len(group)
        spread = scores.std()
        found += [0.0] * len(group) if spread < 1e-6 else ((scores - scores.mean()) / spread).tolist()
    return found


def _datum(prompt: list[int], answer: Answer) -> LossInput:
    """Prompt and answer as one sequence, position i predicting token i + 1, with the sampler's
    log-probability of each answer token; the advantages are the caller's to fill in (0: not trained)."""
    tokens = prompt + answer.tokens
    first = len(prompt) - 1
    logprobs = np.zeros(len(tokens) - 1, np.float32)
    logprobs[first:] = np.nan_to_num(np.asarray(answer.logprobs, np.float32), nan=0.0, neginf=-100.0)
    inputs: dict[str, np.ndarray] = {TARGET_TOKENS: np.asarray(tokens[1:], np.int64), SAMPLING_LOGPROBS: logprobs,
              ADVANTAGES: np.zeros(len(tokens) - 1, np.float32)}
    return LossInput(tokens[:-1], inputs)


def _evaluate(config: ReinforcementConfig, policy: Policy, name: str, valid_set: list[_Prompt]) -> _Tally:
    """The validation prompts' answers by ``name``, scored: the same seed each time, so two evaluations
    differ by the weights alone."""
    groups = policy.sample(name, [p.tokens for p in valid_set], config.eval_samples, config.max_completion_tokens,
                           config.temperature, config.seed)
    tally = _Tally()
    tally.add(policy.grade([p.item for p, group in zip(valid_set, groups) for _ in group],
                           [answer.text for group in groups for answer in group]))
    return tally


def _evaluation_step(
    model: LoopModel, config: ReinforcementConfig, policy: Policy, served: _Served, valid_set: list[_Prompt],
    window: _Tally, metrics: RewardStep, best: BestValidation, output_dir: Path,
) -> RewardStep:
    """An evaluation after ``metrics.step``: the validation reward (without validation prompts, the
    training reward since the last evaluation stands for it), recorded for the best step."""
    if valid_set:
        tally = _evaluate(config, policy, _served_name(model, policy, served, metrics.step, output_dir), valid_set)
        value, metrics = tally.mean, _with_validation(metrics, tally)
    else:
        value = window.mean
    best.record(metrics.step, value, 0.0, lambda: trainable_weights(model.peft_model))
    return metrics


def _with_validation(metrics: RewardStep, tally: _Tally) -> RewardStep:
    return replace(metrics, valid_reward=tally.mean, valid_pass_rate=tally.pass_rate)
