"""The DPO loss (Rafailov et al., 2023), from sequence log-probabilities: the math alone, no model.

For a pair with a preferred answer c and a non-preferred one r to the same prompt, the policy (the
model with the adapter being trained) and the reference (the model it started from) each give the
summed log-probability of each answer's tokens. The implicit reward of an answer is
``beta * (log pi(answer) - log ref(answer))``; the loss pushes the preferred answer's reward above the
other's: ``-logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))``. Nothing here is trained on the
prompt: the log-probabilities are of the answers' tokens only (``preference.py`` masks them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PairScores:
    """Per pair (a tensor of one value per pair): the loss, and the reward margin it is a function of."""

    losses: torch.Tensor  # -logsigmoid(margin): differentiable through the policy's log-probabilities
    margins: torch.Tensor  # beta * ((pi_c - ref_c) - (pi_r - ref_r)), detached: what the metrics report


def dpo_scores(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float,
) -> PairScores:
    """Each argument holds one summed log-probability per pair (the same pairs, in the same order)."""
    margins = beta * ((policy_chosen - reference_chosen) - (policy_rejected - reference_rejected))
    # logsigmoid, not log(sigmoid(.)): exact and finite for large negative margins, where sigmoid underflows.
    return PairScores(losses=-F.logsigmoid(margins), margins=margins.detach())


@dataclass
class PreferenceTally:
    """A step's (or a validation pass's) pairs, summed as they are scored row by row."""

    pairs: int = 0
    loss: float = 0.0  # summed over pairs
    margin: float = 0.0  # summed over pairs
    preferred: int = 0  # pairs whose margin is positive: the policy prefers the preferred answer more than the reference does

    def add(self, scores: PairScores) -> None:
        self.pairs += len(scores.margins)
        self.loss += scores.losses.detach().sum().item()
        self.margin += scores.margins.sum().item()
        self.preferred += int((scores.margins > 0).sum().item())

    def mean_loss(self) -> float:
        return self.loss / self.pairs if self.pairs else float("nan")

    def reward_margin(self) -> float:
        return self.margin / self.pairs if self.pairs else float("nan")

    def accuracy(self) -> float:
        return self.preferred / self.pairs if self.pairs else float("nan")
