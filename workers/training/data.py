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
from dataclasses import dataclass

import torch

from core.chat_tokens import TokenizedExample, example_token_count, tokenize_example
from core.datasets import Example

# The trainer and its tests take the tokenizing from here, with the packing.
__all__ = ["Example", "PackedRow", "TokenizedExample", "example_token_count", "pack", "tokenize_example", "truncate"]


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
    n_tokens: int  # real tokens in the row (all of them: there is no padding)


def pack(examples: list[TokenizedExample], max_row_tokens: int) -> list[PackedRow]:
    """Pack one optimizer step's examples into rows of at most ``max_row_tokens`` tokens.

    Each example's loss is the mean over its trained tokens, and the step's loss is the mean over its
    examples that have any, whatever rows they land in: so the weights are fixed here, for the whole
    step, and the rows' gradients simply add up.
    """
    counted = [example for example in examples if example.n_trained > 0]
    rows: list[list[TokenizedExample]] = []
    # First-fit decreasing: few rows, so few passes; an example longer than a row gets a row alone.
    for example in sorted(examples, key=lambda e: len(e.input_ids), reverse=True):
        row = next(
            (r for r in rows if sum(len(e.input_ids) for e in r) + len(example.input_ids) <= max_row_tokens), None
        )
        if row is None:
            rows.append([example])
        else:
            row.append(example)
    return [_pack_row(row, len(counted)) for row in rows]


def _pack_row(examples: list[TokenizedExample], n_counted: int) -> PackedRow:
    input_ids: list[int] = []
    position_ids: list[int] = []
    loss_positions: list[int] = []
    targets: list[int] = []
    weights: list[float] = []
    for example in examples:
        offset = len(input_ids)
        input_ids += example.input_ids
        position_ids += range(len(example.input_ids))
        # Token i is predicted by the logits at i - 1; the first token of an example has no predictor.
        for i in range(1, len(example.input_ids)):
            if example.trained[i]:
                loss_positions.append(offset + i - 1)
                targets.append(example.input_ids[i])
                weights.append(1.0 / (example.n_trained * n_counted))
    return PackedRow(
        input_ids=torch.tensor([input_ids]),
        position_ids=torch.tensor([position_ids]),
        boundaries=torch.tensor([0, *itertools.accumulate(len(e.input_ids) for e in examples)]),
        loss_positions=torch.tensor(loss_positions, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        weights=torch.tensor(weights),
        n_tokens=len(input_ids),
    )
