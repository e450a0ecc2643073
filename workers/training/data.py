"""From chat examples to the tensors the trainer feeds the model.

An example is a conversation, tokenized by ``core.chat_tokens`` (shared with the upload check, which
must count the same tokens): rendered with the tokenizer's own chat template, and each token marked
as trained or not, so that only assistant replies whose ``weight`` is 1 count in the loss.

Examples of one optimizer step are then *packed*: concatenated into flat rows without padding, with
position ids that restart at 0 for every example, and each example attends only to itself (see
attention.py). The loss is read only at the positions that predict a trained token, so the 49k-wide
vocabulary projection is computed for those positions only.

Why packing rather than length-bucketed padded batches: measured on a 2-core CPU, same examples,
same assistant-only logits, one thread: packed 73-82 tokens/s, bucketed 43-50, padded random batches
37-39. Padding wastes compute, and a padded batch needs masked attention, which SDPA runs on a slower
path than the causal one packed rows get per example.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F

from core.chat_tokens import TokenizedExample, example_token_count, tokenize_example
from core.datasets import Example

# The trainer and its tests take the tokenizing from here, with the packing.
__all__ = [
    "Example", "PackedRow", "TokenizedExample", "example_token_count", "first_fit", "pack", "pack_row",
    "target_log_probs", "tokenize_example", "truncate",
]

Item = TypeVar("Item")


def truncate(example: TokenizedExample, max_len: int) -> TokenizedExample:
    return TokenizedExample(example.input_ids[:max_len], example.trained[:max_len])


@dataclass(frozen=True)
class PackedRow:
    """Several examples laid end to end in one row, ready for one forward pass."""

    input_ids: torch.Tensor  # (1, T)
    position_ids: torch.Tensor  # (1, T), restarting at 0 for each example
    boundaries: torch.Tensor  # (examples + 1,): example j is tokens [boundaries[j], boundaries[j + 1])
    loss_positions: torch.Tensor  # (n,) positions whose next-token logits enter the loss
    targets: torch.Tensor  # (n,) the token each of those positions must predict
    weights: torch.Tensor  # (n,) each target's share of the step's loss
    sequences: torch.Tensor  # (n,) which of the row's examples (0, 1, ... in the order laid) each target is of
    n_tokens: int  # real tokens in the row (all of them: there is no padding)


def pack(examples: list[TokenizedExample], max_row_tokens: int) -> list[PackedRow]:
    """Pack one optimizer step's examples into rows of at most ``max_row_tokens`` tokens.

    Each example's loss is the mean over its trained tokens, and the step's loss is the mean over its
    examples that have any, whatever rows they land in: so the weights are fixed here, for the whole
    step, and the rows' gradients simply add up.
    """
    counted = [example for example in examples if example.n_trained > 0]
    rows = first_fit(examples, lambda example: len(example.input_ids), max_row_tokens)
    return [pack_row(row, len(counted)) for row in rows]


def first_fit(items: list[Item], size: Callable[[Item], int], max_row_tokens: int) -> list[list[Item]]:
    """Items grouped into rows of at most ``max_row_tokens`` by first-fit decreasing: few rows, so few
    passes; an item longer than a row gets a row alone."""
    rows: list[list[Item]] = []
    for item in sorted(items, key=size, reverse=True):
        row = next((r for r in rows if sum(map(size, r)) + size(item) <= max_row_tokens), None)
        if row is None:
            rows.append([item])
        else:
            row.append(item)
    return rows


def pack_row(examples: list[TokenizedExample], n_counted: int) -> PackedRow:
    """``examples`` laid end to end in this order; each trained token weighs 1 / (its example's trained
    tokens x ``n_counted``), its example's share of a mean over ``n_counted`` examples."""
    input_ids: list[int] = []
    position_ids: list[int] = []
    loss_positions: list[int] = []
    targets: list[int] = []
    weights: list[float] = []
    sequences: list[int] = []
    for index, example in enumerate(examples):
        offset = len(input_ids)
        input_ids += example.input_ids
        position_ids += range(len(example.input_ids))
        # Token i is predicted by the logits at i - 1; the first token of an example has no predictor.
        for i in range(1, len(example.input_ids)):
            if example.trained[i]:
                loss_positions.append(offset + i - 1)
                targets.append(example.input_ids[i])
                weights.append(1.0 / (example.n_trained * n_counted))
                sequences.append(index)
    return PackedRow(
        input_ids=torch.tensor([input_ids]),
        position_ids=torch.tensor([position_ids]),
        boundaries=torch.tensor([0, *itertools.accumulate(len(e.input_ids) for e in examples)]),
        loss_positions=torch.tensor(loss_positions, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        weights=torch.tensor(weights),
        sequences=torch.tensor(sequences, dtype=torch.long),
        n_tokens=len(input_ids),
    )


def target_log_probs(model: torch.nn.Module, row: PackedRow) -> torch.Tensor:
    """The log-probability the model gives each of the row's targets: (n,).

    ``model`` is a causal LM loaded with the packed attention (model.py). ``logits_to_keep`` makes it
    apply lm_head only at the positions that predict a trained token: the 49k-wide vocabulary projection
    is the largest matmul in the model, and system, user and weight-0 tokens need none of it.
    """
    out = model(
        input_ids=row.input_ids,
        position_ids=row.position_ids,
        cu_seq_lens_q=row.boundaries,  # per-example attention (attention.py)
        logits_to_keep=row.loss_positions,
        use_cache=False,
    )
    return -F.cross_entropy(out.logits[0].float(), row.targets, reduction="none")
