"""Training throughput: our packed, assistant-only trainer against what a practitioner would pick.

Three trainers train the same LoRA adapter (same model, rank, targets, batch size, learning rate,
schedule, clipping, float32) on the same synthetic chat examples for the same number of optimizer
steps, one after the other in this process, so a noisy machine affects them alike:

- Hugging Face Trainer + PEFT, padded: the usual recipe. A padding collator, labels -100 on everything
  but the weighted assistant tokens (the same mask as ours), and the model's own causal-LM loss over
  the full vocabulary at every position.
- TRL's SFTTrainer + PEFT, padding-free: what a practitioner reaches for today. Each step's examples
  are flattened into one row without padding (``padding_free=True``; the stock SDPA attention keeps
  them apart with a block-diagonal mask that transformers builds from the position ids), the loss is
  on the replies only (completion-only: see ``run_trl``), and TRL computes it with its fused lm_head.
- Ours: packed rows, per-example attention, lm_head only where a trained token is predicted.

Each run trains on the first steps x batch_size examples for one epoch, so all see the same examples.
Tokens are the real (non-padding) tokens of those examples as each trainer tokenized them. Time is
the time spent in optimizer steps (model loading, tokenizing and adapter saving excluded for all).

    python benchmarks/train_throughput.py              # 3 steps of 8 examples each
    python benchmarks/train_throughput.py --steps 25   # the whole 200-example dataset

TRL is an optional extra: .venv/bin/python -m pip install -c constraints.txt ".[bench]"
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from peft import get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    PreTrainedModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from workers.training import StepMetrics, TrainingConfig, train
from workers.training.data import tokenize_example
from workers.training.model import lora_config

BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DATASET_SIZE = 200

WORDS = [
    "the", "model", "learns", "from", "data", "and", "every", "answer", "should", "be", "short", "clear",
    "correct", "when", "a", "user", "asks", "about", "time", "weather", "travel", "cooking", "code", "music",
    "history", "science", "numbers", "city", "river", "mountain", "library", "garden", "because", "we",
    "explain", "why", "it", "works", "first", "then", "how", "to", "use", "in", "practice", "with", "an",
    "example", "or", "two",
]


def synthetic_dataset(seed: int, size: int = DATASET_SIZE) -> list[list[dict]]:
    """Chats of varied shape and length: short and long answers, some system prompts, some two-turn."""
    rng = random.Random(seed)

    def text(low: int, high: int, median: float = 25) -> str:
        n = min(high, max(low, int(rng.lognormvariate(math.log(median), 0.9))))  # long-tailed, like real text
        return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."

    examples = []
    for _ in range(size):
        messages: list[dict[str, Any]] = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": text(5, 30)})
        if rng.random() < 0.2:  # an earlier exchange, sometimes not to be learned from
            messages += [
                {"role": "user", "content": text(3, 40)},
                {"role": "assistant", "content": text(3, 120), "weight": rng.choice([0, 1])},
            ]
        messages += [
            {"role": "user", "content": text(3, 60)},
            {"role": "assistant", "content": text(3, 400, median=40)},
        ]
        examples.append(messages)
    return examples


INSTALL_TRL = '.venv/bin/python -m pip install -c constraints.txt ".[bench]"'


def our_config(model_path: Path, args: argparse.Namespace) -> TrainingConfig:
    """Our trainer's settings, defaults included: the Hugging Face runs copy theirs from it."""
    return TrainingConfig(
        base_model_path=model_path,
        base_model_id=BASE_MODEL_ID,
        n_epochs=1,
        batch_size=args.batch_size,
        learning_rate=2e-4,
        max_steps=args.steps,
        seed=args.seed,
    )


def hf_training_arguments(config: TrainingConfig, output_dir: str) -> dict[str, Any]:
    """What both Hugging Face trainers are told: our optimizer settings, and no saving or progress bars."""
    return {
        "output_dir": output_dir,
        "per_device_train_batch_size": config.batch_size,
        "max_steps": config.max_steps,
        "learning_rate": config.learning_rate,
        "lr_scheduler_type": "linear",
        "warmup_steps": config.warmup_steps,
        "weight_decay": config.weight_decay,
        "max_grad_norm": config.max_grad_norm,
        "seed": config.seed,
        "use_cpu": True,
        "save_strategy": "no",
        "report_to": [],
        "logging_steps": 1,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }


class StepTimer:
    """Our callbacks: the time spent in steps, from each report's tokens and tokens per second."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.tokens = 0

    def on_step(self, metrics: StepMetrics) -> None:
        step_tokens = metrics.trained_tokens - self.tokens
        self.seconds += step_tokens / metrics.tokens_per_second
        self.tokens = metrics.trained_tokens

    def on_checkpoint(self, *args: object) -> None:
        pass

    def should_stop(self) -> bool:
        return False


def run_ours(model_path: Path, examples: list[list[dict]], args: argparse.Namespace) -> tuple[int, float]:
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        result = train(our_config(model_path, args), examples, None, Path(output_dir), timer)
    assert result.steps == args.steps
    return result.trained_tokens, timer.seconds


class HFStepTimer(TrainerCallback):
    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def on_step_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        self._started = time.perf_counter()

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        self.seconds += time.perf_counter() - self._started


def load_base_model(model_path: Path, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)  # the adapter's initial A matrices are random
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    return model


def run_padded(model_path: Path, examples: list[list[dict]], args: argparse.Namespace) -> tuple[int, float]:
    config = our_config(model_path, args)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    features = []
    for example in examples:
        tokens = tokenize_example(tokenizer, example)  # the same tokens and loss mask as ours
        labels = [t if trained else -100 for t, trained in zip(tokens.input_ids, tokens.trained)]
        features.append(
            {"input_ids": tokens.input_ids, "attention_mask": [1] * len(tokens.input_ids), "labels": labels}
        )
    model = get_peft_model(load_base_model(model_path, args.seed), lora_config(config))
    timer = HFStepTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = Trainer(
            model=model,
            args=TrainingArguments(**hf_training_arguments(config, output_dir), remove_unused_columns=False),
            train_dataset=features,
            data_collator=DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100),
            callbacks=[timer],
        )
        trainer.train()
    return sum(len(f["input_ids"]) for f in features), timer.seconds


def prompt_and_completion(example: list[dict]) -> dict[str, list[dict]]:
    """A chat as TRL's conversational prompt-completion record: the last reply is the completion.

    Why not ``assistant_only_loss=True`` on the chats themselves: it needs a chat template with
    ``{% generation %}`` markers, SmolLM2's has none, and TRL 1.16 cannot patch this template (it
    raises "patching is not supported for this template"). Completion-only loss is TRL's equivalent
    here. It differs from ours in one way that costs nothing: an earlier reply with weight 1 (in about
    one example in ten) is prompt here, so untrained; the tokens fed are the same.
    """
    messages = [{"role": m["role"], "content": m["content"]} for m in example]  # TRL knows no "weight"
    return {"prompt": messages[:-1], "completion": messages[-1:]}


def run_trl(model_path: Path, examples: list[list[dict]], args: argparse.Namespace) -> tuple[int, float]:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    config = our_config(model_path, args)
    timer = HFStepTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = SFTTrainer(
            model=load_base_model(model_path, args.seed),
            args=SFTConfig(
                **hf_training_arguments(config, output_dir),
                # Not TRL's packing=True: it fills fixed-length blocks across examples, so a step would no
                # longer be batch_size examples. padding_free flattens each step's examples into one row.
                padding_free=True,
                max_length=None,  # padding_free without packing truncates nothing; no example is near 2048
                completion_only_loss=True,
                bf16=False,  # TRL's default; float32 like the others (bf16 is emulated, and slow, on these CPUs)
                gradient_checkpointing=False,  # TRL's default; it recomputes activations a 135M model has room for
            ),
            train_dataset=Dataset.from_list([prompt_and_completion(e) for e in examples]),
            processing_class=AutoTokenizer.from_pretrained(model_path),
            peft_config=lora_config(config),
            callbacks=[timer],
        )
        tokenized = trainer.train_dataset  # as TRL tokenized it: its own count of the tokens it trains on
        assert isinstance(tokenized, Dataset)
        tokens = sum(len(ids) for ids in tokenized["input_ids"])
        trainer.train()
    return tokens, timer.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps for each trainer (default 3)")
    parser.add_argument("--batch-size", type=int, default=8, help="examples per step (default 8)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: steady on a shared machine; 0 keeps torch's default)",
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--model", type=Path, default=ROOT / "data" / "models" / BASE_MODEL_ID)
    args = parser.parse_args()
    if importlib.util.find_spec("trl") is None:
        parser.exit(2, f"TRL's SFTTrainer is one of the trainers compared, and TRL is not installed: {INSTALL_TRL}\n")
    if args.threads:
        torch.set_num_threads(args.threads)

    dataset = synthetic_dataset(args.seed)
    needed = args.steps * args.batch_size
    if needed > len(dataset):
        parser.error(f"--steps x --batch-size is {needed}: the dataset has {len(dataset)} examples")
    examples = dataset[:needed]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    lengths = [len(tokenize_example(tokenizer, e).input_ids) for e in examples]
    print(
        f"{len(examples)} examples, {sum(lengths)} tokens (min {min(lengths)}, mean {sum(lengths) // len(lengths)}, "
        f"max {max(lengths)}), {args.steps} steps of {args.batch_size}, {torch.get_num_threads()} thread(s)",
        flush=True,
    )

    trainers = (
        ("HF Trainer + PEFT (padded)", run_padded),
        ("TRL SFTTrainer + PEFT (padding-free)", run_trl),
        ("ours (packed, assistant-only logits)", run_ours),
    )
    speeds = {}
    rows = []
    for name, run in trainers:
        tokens, seconds = run(args.model, examples, args)
        speeds[name] = tokens / seconds
        rows.append((name, tokens, seconds))
        print(f"  done: {name}", flush=True)

    ours = speeds[trainers[-1][0]]
    print()
    print(f"{'trainer':<38} {'steps':>5} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'ours / it':>10}")
    for name, tokens, seconds in rows:
        print(
            f"{name:<38} {args.steps:>5} {tokens:>7} {seconds:>8.1f} {speeds[name]:>9.1f} {ours / speeds[name]:>9.2f}x"
        )


if __name__ == "__main__":
    main()
