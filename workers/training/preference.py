"""Preference pairs for DPO: tokenized as chat examples, packed a whole pair at a time, scored against
the reference.

Each answer is its conversation (the pair's input, then the answer) tokenized exactly as a chat example
is (``core.chat_tokens``), so only the answer's tokens are marked: its sequence log-probability is the
sum over those. A pair's two conversations always go into the same packed row, so one forward pass
scores both and each pair's loss is complete after its row: rows' gradients add up to the step's, as
in supervised packing (data.py), and a step holds one row's activations at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from peft import PeftModel
from transformers import PreTrainedTokenizerBase

from core.datasets import PreferencePair
from workers.training.data import PackedRow, TokenizedExample, first_fit, pack_row, target_log_probs, tokenize_example, truncate
from workers.training.model import reference_model
from workers.training.preference_loss import PreferenceTally, dpo_scores


@dataclass(frozen=True)
class TokenizedPair:
    chosen: TokenizedExample  # the input with the preferred answer, the answer's tokens marked
    rejected: TokenizedExample  # the input with the non-preferred answer

    @property
    def n_tokens(self) -> int:
        return len(self.chosen.input_ids) + len(self.rejected.input_ids)

    @property
    def scored(self) -> bool:
        """Both answers kept some tokens (a cut to max_seq_len could take one's all)."""
        return self.chosen.n_trained > 0 and self.rejected.n_trained > 0


def tokenize_pair(tokenizer: PreTrainedTokenizerBase, pair: PreferencePair, max_len: int) -> TokenizedPair:
    return TokenizedPair(
        truncate(tokenize_example(tokenizer, pair.chosen), max_len),
        truncate(tokenize_example(tokenizer, pair.rejected), max_len),
    )


def pack_pairs(pairs: list[TokenizedPair], max_row_tokens: int) -> list[PackedRow]:
    """Rows of whole pairs; in each, pair k's chosen conversation is sequence 2k and its rejected one 2k + 1."""
    rows = first_fit(pairs, lambda pair: pair.n_tokens, max_row_tokens)
    return [pack_row([seq for pair in row for seq in (pair.chosen, pair.rejected)], n_counted=1) for row in rows]


def sequence_log_probs(model: torch.nn.Module, row: PackedRow) -> torch.Tensor:
    """Each of the row's sequences' summed log-probability of its marked (answer) tokens: (sequences,)."""
    n_sequences = len(row.boundaries) - 1
    token_log_probs = target_log_probs(model, row)
    return torch.zeros(n_sequences, dtype=token_log_probs.dtype).index_add(0, row.sequences, token_log_probs)


@torch.no_grad()
def reference_log_probs(model: PeftModel, row: PackedRow) -> torch.Tensor:
    """As ``sequence_log_probs``, by the reference (no dropout, no graph): computed fresh each step, which
    costs a forward pass a row but keeps nothing between steps (and nothing to restore on a resume)."""
    was_training = model.training
    model.eval()
    with reference_model(model):
        log_probs = sequence_log_probs(model, row)
    model.train(was_training)
    return log_probs


def preference_backward(model: PeftModel, batch: list[TokenizedPair], beta: float, max_row_tokens: int) -> PreferenceTally:
    """Forward and backward over one step's pairs, row by row: the gradients add up to those of the
    step's mean DPO loss. Returns the step's tally (its loss, reward margin and accuracy)."""
    tally = PreferenceTally()
    for row in pack_pairs(batch, max_row_tokens):
        reference = reference_log_probs(model, row)
        policy = sequence_log_probs(model, row)
        scores = dpo_scores(policy[0::2], policy[1::2], reference[0::2], reference[1::2], beta)
        (scores.losses.sum() / len(batch)).backward()
        tally.add(scores)
    return tally


@torch.no_grad()
def preference_validation(model: PeftModel, pairs: list[TokenizedPair], beta: float, max_row_tokens: int) -> PreferenceTally:
    """The validation pairs' tally, without dropout: its mean loss is the validation loss."""
    model.eval()
    tally = PreferenceTally()
    for row in pack_pairs(pairs, max_row_tokens):
        reference = reference_log_probs(model, row)
        policy = sequence_log_probs(model, row)
        tally.add(dpo_scores(policy[0::2], policy[1::2], reference[0::2], reference[1::2], beta))
    model.train()
    return tally
