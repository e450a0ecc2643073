"""Data that begin alike, computed once where they are alike.

An RL step trains on K answers to each prompt: K sequences that share their first stretch (the prompt,
often most of each sequence) and differ after it. Laid end to end as separate examples, the prompt is
computed K times, forward and backward. Laid as a tree, the shared stretch comes once, then each
datum's rest, which attends to the stretch and to itself alone (``workers.training.attention``, through
the example's mask), with the position ids it has in its own sequence. Every datum then sees exactly
the context it would see alone, so its logits are the same (within float error) and so are the
gradients, which flow into the shared stretch from each branch and add up there.

Any data sharing at least ``MIN_SHARED_TOKENS`` first tokens are grouped: the caller need not say
which are a prompt's answers, and a Tinker client's own RL loop gains as the platform's RFT does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# A shorter common start saves less than the tree's mask costs.
MIN_SHARED_TOKENS = 8


@dataclass(frozen=True)
class Tree:
    """Some data as one example of a packed row: ``shared`` first tokens once, then each member's rest."""

    members: list[int]  # the data's indices in the batch, in the order their rests are laid
    shared: int  # how many first tokens every member has in common (laid once)
    tokens: torch.Tensor  # (L,) the shared stretch, then each member's rest
    position_ids: torch.Tensor  # (L,) each token's position in its own datum
    positions: list[torch.Tensor]  # per member: where each of its N tokens sits in ``tokens``
    mask: torch.Tensor | None  # (L, L) bool: who attends to whom; None for a lone datum (plain causal)

    @property
    def length(self) -> int:
        return len(self.tokens)


def trees(data: Sequence[torch.Tensor], max_tokens: int) -> list[Tree]:
    """``data`` (each a datum's token ids, 1-D) grouped by their common first tokens into trees of at
    most ``max_tokens`` (a datum longer than that is a tree alone); every datum is in one tree."""
    order = sorted(range(len(data)), key=lambda i: data[i].tolist())  # alike starts end up side by side
    groups: list[tuple[list[int], int]] = []  # (members, tokens they all share)
    for index in order:
        if groups:
            members, shared = groups[-1]
            common = min(shared, _common_start(data[members[-1]], data[index]))
            rests = sum(len(data[m]) - common for m in members) + len(data[index]) - common
            if common >= MIN_SHARED_TOKENS and common + rests <= max_tokens:
                groups[-1] = ([*members, index], common)
                continue
        groups.append(([index], len(data[index])))
    return [_tree([data[m] for m in members], members, shared) for members, shared in groups]


def _common_start(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


def _tree(data: list[torch.Tensor], members: list[int], shared: int) -> Tree:
    if len(members) == 1:
        (datum,) = data
        return Tree(members, shared, datum, torch.arange(len(datum)), [torch.arange(len(datum))], None)
    tokens, position_ids, branch = [data[0][:shared]], [torch.arange(shared)], [torch.zeros(shared, dtype=torch.long)]
    positions, offset = [], shared
    for number, datum in enumerate(data, start=1):
        rest = len(datum) - shared
        tokens.append(datum[shared:])
        position_ids.append(torch.arange(shared, len(datum)))
        branch.append(torch.full((rest,), number))
        positions.append(torch.cat([torch.arange(shared), torch.arange(offset, offset + rest)]))
        offset += rest
    branches = torch.cat(branch)
    # Token i sees token j when j comes no later and is in the shared stretch (branch 0) or i's own branch.
    sees = (branches[None, :] == 0) | (branches[None, :] == branches[:, None])
    mask = torch.tril(torch.ones(offset, offset, dtype=torch.bool)) & sees
    return Tree(members, shared, torch.cat(tokens), torch.cat(position_ids), positions, mask)
