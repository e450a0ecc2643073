"""Training throughput: our packed, assistant-only trainer against a plain Hugging Face Trainer.

Both train the same LoRA adapter (same model, rank, targets, batch size, learning rate, float32) on
the same synthetic chat examples for the same number of optimizer steps, one after the other in
this process, so a noisy machine affects both alike. The baseline is the usual recipe: a padding
collator, labels -100 on everything but the weighted assistant tokens (the same mask as ours), and
the model's own causal-LM loss over the full vocabulary at every position.

Tokens are counted the same way for both: the real (non-padding) tokens of the examples trained on.
Each run trains on the first steps x batch_size examples for one epoch, so both see the same tokens.
Time is the time spent in optimizer steps (model loading and adapter saving excluded for both).

    python benchmarks/train_throughput.py              # 3 steps of 8 examples each
    python benchmarks/train_throughput.py --steps 25   # the whole 200-example dataset
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from workers.training import StepMetrics, TrainingConfig, train
from workers.training.data import tokenize_example

BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DATASET_SIZE = 200

WORDS = [
    "the", "model", "learns", "from", "data", "and", "every", "answer", "should", "be", "short", "clear",
    "correct", "when", "a", "user", "asks", "about", "time", "weather", "travel", "cooking", "code", "music",
    "history", "science", "numbers", "city", "river", "mountain", "library", "garden", "because", "we",
    "explain", "why", "it", "works", "first", "then", "how", "to", "use", "in", "practice", "with", "an",
    "example", "or", "two",
]  # fmt: skip


def synthetic_dataset(seed: int, size: int = DATASET_SIZE) -> list[list[dict]]:
    """Chats of varied shape and length: short and long answers, some system prompts, some two-turn."""
    rng = random.Random(seed)

    def text(low: int, high: int, median: float = 25) -> str:
        n = min(high, max(low, int(rng.lognormvariate(math.log(median), 0.9))))  # long-tailed, like real text
        return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."

    examples = []
    for _ in range(size):
        messages = []
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


class StepTimer:
    """Our callbacks: the time spent in steps, from each report's tokens and tokens per second."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.tokens = 0

    def on_step(self, metrics: StepMetrics) -> None:
        step_tokens = metrics.trained_tokens - self.tokens
        self.seconds += step_tokens / metrics.tokens_per_second
        self.tokens = metrics.trained_tokens

    def on_checkpoint(self, *args) -> None:
        pass

    def should_stop(self) -> bool:
        return False


def run_ours(model_path: Path, examples: list[list[dict]], args: argparse.Namespace) -> tuple[int, float]:
    config = TrainingConfig(
        base_model_path=model_path,
        base_model_id=BASE_MODEL_ID,
        n_epochs=1,
        batch_size=args.batch_size,
        learning_rate=2e-4,
        max_steps=args.steps,
        seed=args.seed,
    )
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        result = train(config, examples, None, Path(output_dir), timer)
    assert result.steps == args.steps
    return result.trained_tokens, timer.seconds


class HFStepTimer(TrainerCallback):
    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds += time.perf_counter() - self._started


def run_baseline(model_path: Path, examples: list[list[dict]], args: argparse.Namespace) -> tuple[int, float]:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    features = []
    for example in examples:
        tokens = tokenize_example(tokenizer, example)  # the same tokens and loss mask as ours
        labels = [t if trained else -100 for t, trained in zip(tokens.input_ids, tokens.trained)]
        features.append(
            {"input_ids": tokens.input_ids, "attention_mask": [1] * len(tokens.input_ids), "labels": labels}
        )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
    model.config.use_cache = False
    model = get_peft_model(
        model,
        LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.05, target_modules="all-linear", bias="none", task_type="CAUSAL_LM"
        ),
    )
    timer = HFStepTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = Trainer(
            model=model,
            args=TrainingArguments(
                output_dir=output_dir,
                per_device_train_batch_size=args.batch_size,
                max_steps=args.steps,
                learning_rate=2e-4,
                lr_scheduler_type="linear",
                weight_decay=0.0,
                max_grad_norm=1.0,
                seed=args.seed,
                use_cpu=True,
                save_strategy="no",
                report_to=[],
                logging_steps=1,
                disable_tqdm=True,
                dataloader_num_workers=0,
                remove_unused_columns=False,
            ),
            train_dataset=features,
            data_collator=DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100),
            callbacks=[timer],
        )
        trainer.train()
    return sum(len(f["input_ids"]) for f in features), timer.seconds


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

    rows = []
    for name, run in (("HF Trainer + PEFT (padded)", run_baseline), ("ours (packed, assistant-only logits)", run_ours)):
        tokens, seconds = run(args.model, examples, args)
        rows.append((name, tokens, seconds))
        print(f"  done: {name}", flush=True)

    print()
    print(f"{'trainer':<38} {'steps':>5} {'tokens':>7} {'seconds':>8} {'tokens/s':>9}")
    for name, tokens, seconds in rows:
        print(f"{name:<38} {args.steps:>5} {tokens:>7} {seconds:>8.1f} {tokens / seconds:>9.1f}")
    (_, base_tokens, base_seconds), (_, our_tokens, our_seconds) = rows
    print(
        f"{'speed-up (ours / baseline)':<38} {'':>5} {'':>7} {'':>8} {(our_tokens / our_seconds) / (base_tokens / base_seconds):>8.2f}x"
    )


if __name__ == "__main__":
    main()
