"""One training run driven step by step from outside, with the Tinker API's semantics: the base model
with a LoRA adapter and its AdamW optimizer, and the calls a client makes of them.

- ``forward_backward`` computes each datum's per-token log-probabilities and a loss (losses.py) and
  adds the loss's gradient to the adapter's: gradients accumulate over calls until ``optim_step``.
- ``optim_step`` applies them with the Adam settings the client gives for that step, then zeroes them.
- ``save_adapter`` writes what the inference pool serves; ``save_state`` adds the optimizer's moments,
  and ``load_state`` goes on from either.

No Django, no queues: ``workers.run_training_loop`` holds one of these for a run and feeds it requests.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from peft import PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file

from core.loop_lora import LORA_ALPHA
from workers.training.data import first_fit
from workers.training.model import TRAINED, build_lora_config, load_base_model, save_adapter
from workers.training_loop.losses import (
    TARGET_TOKENS, LossInputError, Metrics, checked_config, checked_inputs, checked_tokens, combined, loss_function,
)
from workers.training_loop.shared_prefix import Tree, trees

OPTIMIZER_FILE = "optimizer.pt"  # beside the adapter's files in a folder save_state writes
# Data are packed into rows of at most this many tokens, one forward and backward pass per row (a longer
# datum gets a row alone; data sharing their start are one tree, shared_prefix.py). Every position of a
# row is scored, so a row also holds a (tokens x vocabulary) float32 logits matrix: 1,024 tokens of a 49k
# vocabulary are 200 MB, and as much again for its log-softmax and its gradient.
MAX_ROW_TOKENS = 1024
# Where a decoder layer's linear projections sit, by the name of the module holding them (Llama, Qwen2,
# Mistral, Gemma and most others of transformers' decoders).
ATTENTION_MODULES = {"self_attn", "attn", "attention", "self_attention"}
MLP_MODULES = {"mlp", "feed_forward"}


@dataclass(frozen=True)
class LoraShape:
    """The adapter a run trains (Tinker's LoraConfig)."""

    rank: int
    seed: int | None = None  # the A matrices' initialisation; None: whatever torch's generator gives
    train_mlp: bool = True  # LoRA on the MLP projections (gate, up, down)
    train_attn: bool = True  # LoRA on the attention projections (q, k, v, o)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"the LoRA rank must be at least 1, not {self.rank}")
        if not (self.train_mlp or self.train_attn):
            raise ValueError("train_mlp or train_attn must be true: there is nothing else to train")


@dataclass(frozen=True)
class LossInput:
    """One datum of a forward-backward batch."""

    tokens: list[int]  # the model input: N token ids
    # The loss's inputs, each N long, as the Tinker SDK names them: "target_tokens" (int), "weights",
    # "logprobs" (the sampler's), "advantages" (float). Position i of each is about target_tokens[i],
    # the token that should follow tokens[: i + 1].
    inputs: Mapping[str, np.ndarray]


@dataclass(frozen=True)
class ForwardBackwardResult:
    logprobs: list[np.ndarray]  # per datum, float32, N long: log p(target_tokens[i] | tokens[: i + 1])
    metrics: dict[str, float]  # "loss:sum" (the call's summed loss), and the loss's own (losses.py)


@dataclass(frozen=True)
class AdamStep:
    """Tinker's AdamParams: what one optimizer step is taken with."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0  # decoupled (AdamW): the weights shrink by learning_rate * weight_decay
    grad_clip_norm: float = 0.0  # clip the gradients' global norm to this; 0: no clipping

    def check(self) -> None:
        """A ValueError naming the first setting Adam cannot step with."""
        for name in ("learning_rate", "eps", "weight_decay", "grad_clip_norm"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"adam_params.{name}: {value} is not a finite number >= 0")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"adam_params.{name}: {value} is not in [0, 1)")


@dataclass(frozen=True)
class _Datum:
    """A LossInput checked and as tensors."""

    tokens: torch.Tensor  # (N,) int64
    inputs: dict[str, torch.Tensor]  # each (N,)


class LoopModel:
    """The base model (float32, frozen) with a fresh LoRA adapter and an AdamW optimizer over it.

    Not thread-safe: one caller drives it, one call at a time.
    """

    def __init__(self, base_model_path: str, base_model_id: str, lora: LoraShape) -> None:
        """``base_model_id`` is written as base_model_name_or_path in the adapter's config: the
        inference pool matches an adapter to its base model by it."""
        self._lora = lora
        base = load_base_model(base_model_path)
        targets = target_modules(_linear_names(base), train_mlp=lora.train_mlp, train_attn=lora.train_attn)
        # No dropout: Tinker's LoRA has none, and without it a forward is deterministic, so a
        # forward_only call's logprobs are exactly those a training call sees.
        config = build_lora_config(lora.rank, LORA_ALPHA, 0.0, targets)
        with _seeded(lora.seed):
            self._model: PeftModel = get_peft_model(base, config)
        self._model.peft_config[TRAINED].base_model_name_or_path = base_model_id  # not the local folder
        self._model.eval()  # nothing behaves differently in training here, and eval says so
        self._parameters = [p for p in self._model.parameters() if p.requires_grad]
        self._optimizer = self._new_optimizer()
        self._vocab_size = int(self._model.config.vocab_size)

    @property
    def lora(self) -> LoraShape:
        return self._lora

    @property
    def peft_model(self) -> PeftModel:
        """The model itself, to read (tests, diagnostics); train it only through the methods here."""
        return self._model

    def forward_backward(
        self, data: list[LossInput], loss_fn: str, config: Mapping[str, float] | None = None, forward_only: bool = False
    ) -> ForwardBackwardResult:
        """Each datum's target-token logprobs and the call's loss ``loss_fn`` (losses.LOSSES, its
        settings from ``config``); unless ``forward_only``, the loss's gradient is added to the
        gradients already accumulated since the last optim_step.

        Every datum is checked first: a LossInputError leaves the gradients as they were.
        """
        loss = loss_function(loss_fn)
        settings = checked_config(loss_fn, config)
        batch = self._checked(data, loss_fn)
        logprobs: list[np.ndarray] = [np.empty(0, np.float32)] * len(batch)
        per_datum: list[tuple[Metrics, int]] = []
        # Data sharing their start (a prompt's answers) are laid as trees, the start computed once.
        laid = trees([datum.tokens for datum in batch], MAX_ROW_TOKENS)
        with torch.set_grad_enabled(not forward_only):
            for row in first_fit(laid, lambda tree: tree.length, MAX_ROW_TOKENS):
                row_loss = torch.zeros(())
                for i, datum_logprobs in self._row_logprobs(row, batch):
                    datum_loss, metrics = loss(datum_logprobs, batch[i].inputs, settings)
                    row_loss = row_loss + datum_loss
                    per_datum.append(({"loss:sum": datum_loss.item(), **metrics}, len(batch[i].tokens)))
                    logprobs[i] = datum_logprobs.detach().numpy().astype(np.float32)
                if not forward_only:
                    row_loss.backward()  # adds to .grad: the rows' gradients sum to the call's
        return ForwardBackwardResult(logprobs, combined(per_datum))

    def base_logprobs(self, data: list[LossInput], loss_fn: str) -> list[np.ndarray]:
        """Each datum's target-token logprobs under the base model alone, the adapter switched off:
        the reference a KL term measures the trained policy against (``data`` checked as for ``loss_fn``)."""
        with self._model.disable_adapter():
            return self.forward_backward(data, loss_fn, forward_only=True).logprobs

    def optim_step(self, step: AdamStep) -> dict[str, float]:
        """Apply the accumulated gradients with ``step``'s settings, then zero them. Returns
        "grad_norm", the gradients' global norm before any clipping (0 when there were none)."""
        step.check()
        for group in self._optimizer.param_groups:
            group.update(
                lr=step.learning_rate, betas=(step.beta1, step.beta2), eps=step.eps, weight_decay=step.weight_decay
            )
        grad_norm = self._grad_norm(step.grad_clip_norm)
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "learning_rate": step.learning_rate}

    def save_adapter(self, folder: Path) -> Path:
        """The adapter alone, in PEFT's layout (what the inference pool loads), written atomically."""
        return save_adapter(self._model, Path(folder))

    def save_state(self, folder: Path) -> Path:
        """The adapter and the optimizer's state (OPTIMIZER_FILE, loadable with ``weights_only``):
        what ``load_state`` goes on from. Atomic: a reader sees no folder or a complete one."""
        folder = Path(folder)
        staging = folder.with_name(f".{folder.name}.state-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        save_adapter(self._model, staging)
        torch.save({"optimizer": self._optimizer.state_dict()}, staging / OPTIMIZER_FILE)
        shutil.rmtree(folder, ignore_errors=True)  # saving under a name again replaces it
        staging.rename(folder)
        return folder

    def load_state(self, folder: Path, with_optimizer: bool) -> None:
        """Put back the adapter of ``folder`` (written by save_state, or by save_adapter when
        ``with_optimizer`` is False) and, with ``with_optimizer``, the optimizer's moments; without,
        the optimizer starts afresh. Gradients accumulated before are dropped.

        A ValueError, changing nothing, when the folder's adapter has another shape (rank, alpha,
        modules) or it holds no optimizer state that was asked for.
        """
        folder = Path(folder)
        self._check_same_shape(json.loads((folder / "adapter_config.json").read_text()))
        weights = load_file(folder / "adapter_model.safetensors")
        missing = sorted(set(get_peft_model_state_dict(self._model)) - set(weights))
        if missing:
            raise ValueError(f"{folder} lacks {len(missing)} of the adapter's matrices, e.g. {missing[0]}")
        optimizer = self._new_optimizer()
        if with_optimizer:
            optimizer.load_state_dict(self._read_optimizer_state(folder))
        # Everything was read and fits: only now is the model changed.
        set_peft_model_state_dict(self._model, weights)
        self._optimizer = optimizer
        self._optimizer.zero_grad(set_to_none=True)

    def _checked(self, data: list[LossInput], loss_fn: str) -> list[_Datum]:
        if not data:
            raise LossInputError("data: give at least one datum")
        batch = []
        for index, datum in enumerate(data):
            tokens = checked_tokens(index, datum.tokens, self._vocab_size)
            batch.append(_Datum(tokens, checked_inputs(index, len(tokens), datum.inputs, loss_fn, self._vocab_size)))
        return batch

    def _row_logprobs(self, row: list[Tree], batch: list[_Datum]) -> Iterator[tuple[int, torch.Tensor]]:
        """One forward pass over ``row``'s trees laid end to end (each attends only to itself): each
        member datum's index in ``batch`` and the log-probabilities of its target tokens, in order."""
        lengths = [tree.length for tree in row]
        out = self._model(
            input_ids=torch.cat([tree.tokens for tree in row]).unsqueeze(0),
            position_ids=torch.cat([tree.position_ids for tree in row]).unsqueeze(0),
            cu_seq_lens_q=torch.tensor([0, *np.cumsum(lengths).tolist()]),  # per-tree attention (attention.py)
            example_masks=[tree.mask for tree in row],
            use_cache=False,
        )
        # Every position predicts its datum's next target; a shared position, the next of each member.
        log_probs = torch.log_softmax(out.logits[0].float(), dim=-1)
        members, positions, offset = [], [], 0
        for tree in row:
            members += tree.members
            positions += [offset + member_positions for member_positions in tree.positions]
            offset += tree.length
        # One gather for the whole row: each indexing's backward zero-fills a gradient the size of
        # log_probs (positions x vocabulary), so one a datum cost more than the row's matmuls.
        targets = [batch[i].inputs[TARGET_TOKENS] for i in members]
        picked = log_probs[torch.cat(positions), torch.cat(targets)]
        yield from zip(members, picked.split([len(t) for t in targets]), strict=True)

    def _grad_norm(self, clip_norm: float) -> float:
        grads = [p.grad for p in self._parameters if p.grad is not None]
        if not grads:
            return 0.0
        if clip_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(self._parameters, clip_norm))
        return float(torch.nn.utils.get_total_norm(grads))

    def _new_optimizer(self) -> torch.optim.AdamW:
        # Its settings are placeholders: optim_step sets them from each step's AdamStep.
        defaults = AdamStep()
        return torch.optim.AdamW(
            self._parameters, lr=defaults.learning_rate, betas=(defaults.beta1, defaults.beta2), eps=defaults.eps,
            weight_decay=defaults.weight_decay,
        )

    def _check_same_shape(self, adapter_config: dict) -> None:
        ours = self._model.peft_config[TRAINED]
        if adapter_config.get("r") != ours.r:
            raise ValueError(
                f"the saved adapter has LoRA rank {adapter_config.get('r')}, this run's is {ours.r}: "
                "load it into a run of the same rank"
            )
        if adapter_config.get("lora_alpha") != ours.lora_alpha:
            raise ValueError(
                f"the saved adapter has lora_alpha {adapter_config.get('lora_alpha')}, this run's is {ours.lora_alpha}"
            )
        saved_targets = set(adapter_config.get("target_modules") or [])
        if saved_targets != set(ours.target_modules):
            raise ValueError(
                f"the saved adapter trains {sorted(saved_targets)}, this run trains {sorted(ours.target_modules)}: "
                "load it into a run with the same train_mlp and train_attn"
            )

    def _read_optimizer_state(self, folder: Path) -> dict:
        path = folder / OPTIMIZER_FILE
        if not path.is_file():
            raise ValueError(f"{folder} holds no optimizer state ({OPTIMIZER_FILE}): load it without the optimizer")
        return torch.load(path, weights_only=True)["optimizer"]


def target_modules(linear_names: Iterable[str], train_mlp: bool, train_attn: bool) -> list[str]:
    """The LoRA's target modules among a model's linear layers (given by their full dotted names): the
    names PEFT matches by suffix (e.g. "q_proj") of those inside an attention module, an MLP or both.
    lm_head, in neither, is never a target (vLLM serves adapters of the decoder layers only)."""
    wanted = (ATTENTION_MODULES if train_attn else set()) | (MLP_MODULES if train_mlp else set())
    names = {name.rpartition(".")[2] for name in linear_names if wanted & set(name.split(".")[:-1])}
    if not names:
        raise ValueError("this model has no attention or MLP projections that LoRA knows how to target")
    return sorted(names)


def _linear_names(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


@contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """Within it torch's generator starts from ``seed`` (when given); the caller's is left as it was."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
