"""DPO throughput: our preference trainer against TRL's DPOTrainer, both training a PEFT LoRA adapter.

Both train the same adapter (same model, rank, targets, batch size, learning rate, beta, float32) on the
same preference pairs for the same number of optimizer steps, one after the other in this process, so a
noisy machine affects them alike. Both use the model with the adapter switched off as the reference,
computed afresh every step (TRL: ``ref_model=None`` with a ``peft_config``, ``precompute_ref_log_probs``
off), and score each answer by the summed log-probabilities of its tokens.

- TRL's DPOTrainer + PEFT, padded: its only layout in TRL 1.16 (``padding_free=True`` is "temporarily
  unavailable after a refactor" there and falls back to padding); its loss is ``sigmoid`` DPO, as ours.
- Ours: both answers of each pair packed in one row (``workers/training/preference.py``), per-example
  attention, lm_head only where an answer's token is predicted.

The pairs are built from the synthetic chats of ``train_throughput.py``: the prompt is a chat without its
last reply; the preferred answer is that reply, the other another chat's reply. Time is the time spent in
optimizer steps (loading, tokenizing and saving excluded for both).

    python benchmarks/dpo_bench.py              # 3 steps of 2 pairs each
    python benchmarks/dpo_bench.py --steps 10

Mind TRL's memory: at 2 pairs a step this process peaked at 3.3 GB; at 8 pairs a step (about 270
tokens a pair) TRL's DPOTrainer alone went past 16 GB and was killed for lack of memory.

TRL is an optional extra: .venv/bin/python -m pip install -c constraints.txt ".[bench]"
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch
from transformers import AutoTokenizer

from benchmarks.train_throughput import (
    BASE_MODEL_ID,
    INSTALL_TRL,
    HFStepTimer,
    StepTimer,
    hf_training_arguments,
    load_base_model,
    synthetic_dataset,
)
from core.datasets import PreferencePair
from workers.training import TrainingConfig, train
from workers.training.model import lora_config
from workers.training.preference import tokenize_pair

BETA = 0.1


def preference_pairs(seed: int, count: int) -> list[PreferencePair]:
    chats = synthetic_dataset(seed)
    rng = random.Random(seed)
    pairs = []
    for chat in chats[:count]:
        prompt = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in chat[:-1]]
        other = rng.choice([c for c in chats if c is not chat])[-1]
        pairs.append(PreferencePair(prompt, {**chat[-1], "weight": 1}, {**other, "weight": 1}))
    return pairs


def our_config(model_path: Path, args: argparse.Namespace) -> TrainingConfig:
    """Our trainer's settings, defaults included: TRL's run copies its optimizer settings from it."""
    return TrainingConfig(
        base_model_path=model_path, base_model_id=BASE_MODEL_ID, method="dpo", beta=BETA, n_epochs=1,
        batch_size=args.batch_size, learning_rate=5e-5, max_steps=args.steps, seed=args.seed,
    )


def run_ours(model_path: Path, pairs: list[PreferencePair], args: argparse.Namespace) -> float:
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        result = train(our_config(model_path, args), pairs, None, Path(output_dir), timer)
    assert result.steps == args.steps
    return timer.seconds


def trl_record(pair: PreferencePair) -> dict:
    """A pair as TRL's conversational preference record (TRL knows no "weight")."""
    plain = lambda messages: [{"role": m["role"], "content": m["content"]} for m in messages]  # noqa: E731
    return {"prompt": plain(pair.prompt), "chosen": plain([pair.preferred]), "rejected": plain([pair.non_preferred])}


def run_trl(model_path: Path, pairs: list[PreferencePair], args: argparse.Namespace) -> float:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    config = our_config(model_path, args)
    timer = HFStepTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = DPOTrainer(
            model=load_base_model(model_path, args.seed),
            ref_model=None,  # with a peft_config: the model with the adapter disabled, as ours
            args=DPOConfig(
                **hf_training_arguments(config, output_dir),
                beta=BETA,
                padding_free=False,  # TRL 1.16 turns padding_free off for DPO (see the docstring)
                max_length=None,  # no pair is near the context
                bf16=False,  # float32 like ours (bf16 is emulated, and slow, on these CPUs)
                gradient_checkpointing=False,
            ),
            train_dataset=Dataset.from_list([trl_record(pair) for pair in pairs]),
            processing_class=AutoTokenizer.from_pretrained(model_path),
            peft_config=lora_config(config),
            callbacks=[timer],
        )
        trainer.train()
    return timer.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps for each trainer (default 3)")
    parser.add_argument("--batch-size", type=int, default=2, help="pairs per step (default 2: TRL's memory, see above)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0 keeps torch's default)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--model", type=Path, default=ROOT / "data" / "models" / BASE_MODEL_ID)
    args = parser.parse_args()
    if importlib.util.find_spec("trl") is None:
        parser.exit(2, f"TRL's DPOTrainer is the baseline, and TRL is not installed: {INSTALL_TRL}\n")
    if args.threads:
        torch.set_num_threads(args.threads)

    pairs = preference_pairs(args.seed, args.steps * args.batch_size)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokens = [tokenize_pair(tokenizer, pair, 2048).n_tokens for pair in pairs]
    print(
        f"{len(pairs)} pairs, {sum(tokens)} tokens (both conversations; mean {sum(tokens) // len(tokens)} a pair), "
        f"{args.steps} steps of {args.batch_size}, beta {BETA}, {torch.get_num_threads()} thread(s)",
        flush=True,
    )
    trainers = (("TRL DPOTrainer + PEFT (padded)", run_trl), ("ours (pairs packed, answer-only logits)", run_ours))
    rows = []
    for name, run in trainers:
        seconds = run(args.model, pairs, args)
        rows.append((name, seconds, len(pairs) / seconds))
        print(f"  done: {name}", flush=True)

    ours = rows[-1][2]
    print()
    print(f"{'trainer':<40} {'steps':>5} {'pairs':>6} {'seconds':>8} {'pairs/s':>8} {'ours / it':>10}")
    for name, seconds, speed in rows:
        print(f"{name:<40} {args.steps:>5} {len(pairs):>6} {seconds:>8.1f} {speed:>8.2f} {ours / speed:>9.2f}x")


if __name__ == "__main__":
    main()
