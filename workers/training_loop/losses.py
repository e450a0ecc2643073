"""The loss functions of a forward-backward call, as Tinker defines them, and the checks on their inputs.

A loss takes one datum's per-token log-probabilities of its target tokens under the model being
trained (with grad) and the datum's inputs, and returns the datum's loss as a *sum* over its tokens:
Tinker never averages, so a caller who wants a mean scales its weights or advantages. The gradient of
a call is the gradient of the sum of its data's losses.

Every input is checked here, before any forward pass, so that a bad request changes nothing: the
error names the datum and the field as the Tinker SDK spells them (``data[2].loss_fn_inputs.advantages``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

TARGET_TOKENS, WEIGHTS, SAMPLING_LOGPROBS, ADVANTAGES = "target_tokens", "weights", "logprobs", "advantages"
CLIP_LOW, CLIP_HIGH = "clip_low_threshold", "clip_high_threshold"  # PPO's loss_fn_config keys

Inputs = dict[str, torch.Tensor]  # by name, each (N,): target_tokens int64, the others float32
Metrics = dict[str, float]  # named "<what>:<how it combines across data>", Tinker's convention


class LossInputError(ValueError):
    """A forward-backward request the loss cannot take: the message names the datum and field."""


@dataclass(frozen=True)
class LossFunction:
    inputs: tuple[str, ...]  # the loss_fn_inputs it reads; others a datum carries are ignored
    compute: Callable[[torch.Tensor, Inputs, Mapping[str, float]], tuple[torch.Tensor, Metrics]]
    config: Mapping[str, float] = field(default_factory=dict)  # the loss_fn_config keys it takes, with defaults

    def __call__(
        self, target_logprobs: torch.Tensor, inputs: Inputs, config: Mapping[str, float]
    ) -> tuple[torch.Tensor, Metrics]:
        """The datum's summed loss (a scalar tensor, with grad when ``target_logprobs`` has it) and
        its extra metrics ("loss:sum" is the caller's to add)."""
        return self.compute(target_logprobs, inputs, config)


def cross_entropy(
    target_logprobs: torch.Tensor, inputs: Inputs, config: Mapping[str, float]
) -> tuple[torch.Tensor, Metrics]:
    """Supervised learning: the weighted negative log-likelihood of the target tokens."""
    return -(inputs[WEIGHTS] * target_logprobs).sum(), {}


def importance_sampling(
    target_logprobs: torch.Tensor, inputs: Inputs, config: Mapping[str, float]
) -> tuple[torch.Tensor, Metrics]:
    """Policy gradient corrected for the sampler being another (older) policy: each token's advantage
    weighed by p_trained / p_sampler."""
    ratio = _ratio(target_logprobs, inputs)
    return -(ratio * inputs[ADVANTAGES]).sum(), {"ratio:mean": ratio.mean().item()}


def ppo(target_logprobs: torch.Tensor, inputs: Inputs, config: Mapping[str, float]) -> tuple[torch.Tensor, Metrics]:
    """PPO's clipped objective: the pessimistic (smaller) of the ratio-weighted advantage and the same
    with the ratio clamped to [clip_low_threshold, clip_high_threshold]. Tokens where the clamped term
    wins give no gradient: the policy has already moved far enough for them."""
    ratio = _ratio(target_logprobs, inputs)
    advantages = inputs[ADVANTAGES]
    unclipped = ratio * advantages
    clipped = ratio.clamp(config[CLIP_LOW], config[CLIP_HIGH]) * advantages
    objective = torch.minimum(unclipped, clipped)
    metrics = {"ratio:mean": ratio.mean().item(), "clipped:mean": (clipped < unclipped).float().mean().item()}
    return -objective.sum(), metrics


def _ratio(target_logprobs: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    return torch.exp(target_logprobs - inputs[SAMPLING_LOGPROBS])


LOSSES: dict[str, LossFunction] = {
    "cross_entropy": LossFunction((TARGET_TOKENS, WEIGHTS), cross_entropy),
    "importance_sampling": LossFunction((TARGET_TOKENS, SAMPLING_LOGPROBS, ADVANTAGES), importance_sampling),
    "ppo": LossFunction((TARGET_TOKENS, SAMPLING_LOGPROBS, ADVANTAGES), ppo, {CLIP_LOW: 0.8, CLIP_HIGH: 1.2}),
}


def loss_function(name: str) -> LossFunction:
    """The loss called ``name``, or a LossInputError listing the known ones."""
    if name not in LOSSES:
        raise LossInputError(f"loss_fn {name!r} is not one of {', '.join(LOSSES)}")
    return LOSSES[name]


def checked_config(name: str, config: Mapping[str, float] | None) -> dict[str, float]:
    """The loss's config: its defaults, overridden by ``config``. A key the loss does not take is an
    error rather than ignored: a misspelt threshold would otherwise train with the default silently."""
    loss = loss_function(name)
    settings = dict(loss.config)
    for key, value in (config or {}).items():
        if key not in loss.config:
            takes = f"takes {', '.join(loss.config)}" if loss.config else "takes no config"
            raise LossInputError(f"loss_fn_config.{key}: {name} {takes}")
        settings[key] = _finite(f"loss_fn_config.{key}", value)
    if CLIP_LOW in settings and settings[CLIP_LOW] > settings[CLIP_HIGH]:
        raise LossInputError(
            f"loss_fn_config.{CLIP_LOW}: {settings[CLIP_LOW]} is above {CLIP_HIGH} {settings[CLIP_HIGH]}"
        )
    return settings


def _finite(where: str, value: object) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]  # anything float() takes: ints, numpy scalars
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number):
        raise LossInputError(f"{where}: {value!r} is not a finite number")
    return number


def checked_tokens(index: int, tokens: list[int], vocab_size: int) -> torch.Tensor:
    """The datum's model input as (N,) int64, every id a token of the vocabulary."""
    where = f"data[{index}].model_input"
    if len(tokens) == 0:
        raise LossInputError(f"{where}: holds no tokens")
    ids = np.asarray(tokens)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise LossInputError(f"{where}: give a flat list of integer token ids")
    _check_ids(where, ids, vocab_size)
    return torch.from_numpy(ids.astype(np.int64))


def checked_inputs(index: int, n_tokens: int, inputs: Mapping[str, object], name: str, vocab_size: int) -> Inputs:
    """The inputs loss ``name`` reads, each (N,) with N = ``n_tokens``, as tensors: target_tokens
    int64 ids of the vocabulary, the others finite float32."""
    loss = loss_function(name)
    checked: Inputs = {}
    for key in loss.inputs:
        where = f"data[{index}].loss_fn_inputs.{key}"
        if key not in inputs:
            raise LossInputError(f"{where}: missing ({name} needs {', '.join(loss.inputs)})")
        values = np.asarray(inputs[key])
        if values.ndim != 1:
            raise LossInputError(f"{where}: give a 1-D array, not one of shape {values.shape}")
        if len(values) != n_tokens:
            raise LossInputError(f"{where}: {len(values)} values for {n_tokens} tokens")
        checked[key] = _target_ids(where, values, vocab_size) if key == TARGET_TOKENS else _numbers(where, values)
    return checked


def _target_ids(where: str, values: np.ndarray, vocab_size: int) -> torch.Tensor:
    if values.dtype.kind not in "iu":
        raise LossInputError(f"{where}: give integer token ids, not {values.dtype}")
    _check_ids(where, values, vocab_size)
    return torch.from_numpy(values.astype(np.int64))


def _numbers(where: str, values: np.ndarray) -> torch.Tensor:
    if values.dtype.kind not in "fiu":
        raise LossInputError(f"{where}: give numbers, not {values.dtype}")
    values = values.astype(np.float32)
    if not np.isfinite(values).all():
        raise LossInputError(f"{where}: holds NaN or infinity; give finite numbers")
    return torch.from_numpy(values)


def _check_ids(where: str, ids: np.ndarray, vocab_size: int) -> None:
    outside = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if outside.size:
        position = int(outside[0])
        raise LossInputError(
            f"{where}: token id {int(ids[position])} at position {position} is outside the vocabulary (0 to {vocab_size - 1})"
        )


def combined(per_datum: list[tuple[Metrics, int]]) -> Metrics:
    """The call's metrics from each datum's and its token count, by the name's suffix: ":sum" adds
    up, ":mean" is the mean over all the call's tokens, ":max" and ":min" as named."""
    combined_metrics: Metrics = {}
    names = {name for metrics, _ in per_datum for name in metrics}
    for name in sorted(names):
        values = [(metrics[name], n) for metrics, n in per_datum if name in metrics]
        how = name.rpartition(":")[2]
        if how == "mean":
            combined_metrics[name] = sum(v * n for v, n in values) / max(1, sum(n for _, n in values))
        elif how == "max":
            combined_metrics[name] = max(v for v, _ in values)
        elif how == "min":
            combined_metrics[name] = min(v for v, _ in values)
        else:
            combined_metrics[name] = sum(v for v, _ in values)
    return combined_metrics
