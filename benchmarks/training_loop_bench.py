"""A Tinker-style supervised loop against our own fine-tuning job's trainer, on the same data.

Both train a LoRA of the same rank on the same synthetic chats (``train_throughput.synthetic_dataset``)
for the same number of optimizer steps of the same examples, one after the other in this process:

- the job's trainer (``workers.training.train``): packed rows, assistant-only logits, a linear
  schedule with warmup, weight decay and clipping, as a fine-tuning job runs it;
- the training loop's model (``workers.training_loop.LoopModel``), driven as a Tinker user's loop
  drives it: per step one ``forward_backward(cross_entropy)`` over the batch (weights 1 on the
  assistant tokens) and one ``optim_step`` at a constant learning rate. This is the engine behind
  ``/api/v1/forward_backward``, without the HTTP, protobuf and Redis hops.

The table gives tokens per second (time in steps only: loading and tokenizing excluded) and each
step's loss side by side (per-token mean for the loop; the job reports the mean of each example's
per-token mean, so the two curves differ by that weighting as well as by the schedule).

    python benchmarks/training_loop_bench.py              # 6 steps of 8 examples
    python benchmarks/training_loop_bench.py --steps 25
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
from transformers import AutoTokenizer

from benchmarks.train_throughput import BASE_MODEL_ID, StepTimer, our_config, synthetic_dataset
from workers.training import StepMetrics, train
from workers.training.data import tokenize_example
from workers.training_loop.loop_model import AdamStep, LoopModel, LoraShape, LossInput


class LossRecorder(StepTimer):
    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def on_step(self, metrics: StepMetrics) -> None:
        super().on_step(metrics)
        self.losses.append(metrics.train_loss)


def run_job_trainer(model: Path, examples: list[list[dict]], args: argparse.Namespace) -> tuple[int, float, list[float]]:
    recorder = LossRecorder()
    with tempfile.TemporaryDirectory() as output:
        result = train(our_config(model, args), examples, None, Path(output), recorder)
    return result.trained_tokens, recorder.seconds, recorder.losses


def run_loop(model: Path, examples: list[list[dict]], args: argparse.Namespace) -> tuple[int, float, list[float]]:
    config = our_config(model, args)
    tokenizer = AutoTokenizer.from_pretrained(model)
    loop = LoopModel(str(model), BASE_MODEL_ID, LoraShape(config.lora_r, seed=args.seed))
    tokens = seconds = 0.0
    losses = []
    for step in range(args.steps):
        batch = []
        for example in examples[step * args.batch_size : (step + 1) * args.batch_size]:
            tokenized = tokenize_example(tokenizer, example)
            ids, weights = tokenized.input_ids, [float(trained) for trained in tokenized.trained]
            inputs = {"target_tokens": np.array(ids[1:]), "weights": np.array(weights[1:], dtype=np.float32)}
            batch.append(LossInput(ids[:-1], inputs))
            tokens += len(ids)
        started = time.perf_counter()
        result = loop.forward_backward(batch, "cross_entropy")
        loop.optim_step(AdamStep(learning_rate=config.learning_rate, grad_clip_norm=config.max_grad_norm))
        seconds += time.perf_counter() - started
        trained = sum(float(datum.inputs["weights"].sum()) for datum in batch)
        losses.append(result.metrics["loss:sum"] / trained)
    return int(tokens), seconds, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steady on a shared machine)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--model", type=Path, default=ROOT / "data" / "models" / BASE_MODEL_ID)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    examples = synthetic_dataset(args.seed)[: args.steps * args.batch_size]

    job_tokens, job_seconds, job_losses = run_job_trainer(args.model, examples, args)
    loop_tokens, loop_seconds, loop_losses = run_loop(args.model, examples, args)
    job_speed, loop_speed = job_tokens / job_seconds, loop_tokens / loop_seconds
    print(f"\n{len(examples)} examples, {args.steps} steps of {args.batch_size}, {torch.get_num_threads()} thread(s)\n")
    print(f"{'trainer':<34} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'vs the job':>10}")
    print(f"{'fine-tuning job (train())':<34} {job_tokens:>7} {job_seconds:>8.1f} {job_speed:>9.1f} {1.0:>9.2f}x")
    print(f"{'Tinker-style loop (LoopModel)':<34} {loop_tokens:>7} {loop_seconds:>8.1f} {loop_speed:>9.1f} {loop_speed / job_speed:>9.2f}x")
    print(f"\n{'step':>4} {'job loss':>9} {'loop loss':>10}")
    for step, (job, loop) in enumerate(zip(job_losses, loop_losses), start=1):
        print(f"{step:>4} {job:>9.4f} {loop:>10.4f}")


if __name__ == "__main__":
    main()
