"""From chat examples to the tensors the trainer feeds the model.

An example is a conversation: a list of ``{"role", "content", "weight"?}`` messages. It is rendered
with the tokenizer's own chat template (the one the inference engine applies), tokenized once, and
each token is marked as trained or not: only the tokens of assistant messages whose ``weight`` is 1
(their content and the end-of-turn token) count in the loss.

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
from typing import Any

import torch

Message = dict[str, Any]
Example = list[Message]


@dataclass(frozen=True)
class TokenizedExample:
    input_ids: list[int]
    trained: list[bool]  # trained[i]: token i is a target of the loss (predicted from token i - 1)

    @property
    def n_trained(self) -> int:
        return sum(self.trained)


def _render(tokenizer, messages: Example, add_generation_prompt: bool = False) -> str:
    # Only role and content go to the template: "weight" is ours, and some templates choke on extras.
    plain = [{"role": message["role"], "content": message["content"]} for message in messages]
    return tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_generation_prompt)


def _reply_spans(tokenizer, example: Example, text: str) -> list[tuple[int, int, bool]]:
    """(start, end, trained) character spans of ``text`` that hold the assistant replies.

    The conversation is rendered prefix by prefix: a reply starts where the prefix before it, plus
    the template's assistant header (the generation prompt), ends, and stops where the prefix
    including it ends. That needs a template whose renderings of prefixes are prefixes of the whole
    rendering; one that is not (for example one that rewrites earlier turns) is refused loudly
    rather than trained with a silently wrong mask.
    """
    spans = []
    for index, message in enumerate(example):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, example[:index], add_generation_prompt=True)
        through = _render(tokenizer, example[: index + 1])
        if not (text.startswith(through) and through.startswith(before)):
            raise ValueError(
                f"the chat template does not render message {index} of this conversation as a prefix "
                "of the whole conversation, so its assistant tokens cannot be located"
            )
        # The template's whitespace after the end-of-turn token is never generated: leave it out.
        end = max(len(through.rstrip()), len(before))
        spans.append((len(before), end, message.get("weight", 1) != 0))
    return spans


def tokenize_example(tokenizer, example: Example) -> TokenizedExample:
    """The tokens of one conversation, rendered by the chat template, and which of them are trained.

    The text is tokenized piece by piece, cut where replies start and end, so a reply's tokens follow
    exactly the tokens its prompt gets at inference (the rendering up to the assistant header,
    tokenized alone). Tokenizing the whole text at once would let BPE merge the header's newline with a
    reply that starts with whitespace (" Paris", common in prompt/completion data) into a token the
    model never sees after a prompt. Every reply is cut out, weighted or not, so weights never change
    the tokens.
    """
    text = _render(tokenizer, example)
    input_ids: list[int] = []
    trained: list[bool] = []

    def add(piece: str, is_trained: bool) -> None:
        # The template writes its own special tokens: the tokenizer must not add a BOS of its own.
        ids = tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
        input_ids.extend(ids)
        trained.extend([is_trained] * len(ids))

    cursor = 0
    for start, end, is_trained in _reply_spans(tokenizer, example, text):
        add(text[cursor:start], False)
        add(text[start:end], is_trained)
        cursor = end
    add(text[cursor:], False)
    if trained:
        trained[0] = False  # nothing predicts the first token, so it can never be a target
    return TokenizedExample(input_ids=input_ids, trained=trained)


def example_token_count(tokenizer, example: Example) -> int:
    """Tokens of the example as the trainer feeds it to the model (before any max_seq_len cut)."""
    return len(tokenize_example(tokenizer, example).input_ids)


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
    input_ids, position_ids, loss_positions, targets, weights = [], [], [], [], []
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
