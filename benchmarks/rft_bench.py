"""Reinforcement fine-tuning step: our loop, sampling through the serving pool, against TRL's GRPOTrainer.

Both train the same LoRA adapter of SmolLM2-135M-Instruct (rank 8, alpha 32, every linear projection,
no dropout, float32) on the same 16 yes/no questions, 4 prompts a step and K answers to each (at most
M tokens, temperature 1), rewarded by the same grader (text_similarity fuzzy_match of the answer
against the line's reference_answer, "Yes": ``core.graders.engine``), with group-normalised
advantages, the same learning rate and KL weight to the base model (0.02), for the same steps:

- Ours: ``workers/training_loop/reinforcement.py``'s ``train_by_reward``, given the job's Policy
  (``workers/run_reinforcement.py``'s PoolPolicy) without Django: each step's weights written to the
  dynamic LoRA path as a pinned revision (``<base>:<suffix>@r<N>``), the answers sampled by a real
  inference pool (one vLLM CPU replica, the repository's catalog, a scratch adapter folder), graded here.
  The pool is part of our system (it is what samples), so it runs beside our steps; it is stopped
  before TRL's run, which then has both cores to itself.
- TRL's GRPOTrainer + PEFT: sampling with transformers' ``generate`` (``use_vllm=False``: no GPU), its
  reference the model with the adapter off; ``loss_type="grpo"`` (each answer's tokens averaged, as ours).

Figure of merit: samples per second, answers sampled, graded and trained on per second of step time
(model loading excluded for both: ours is the loop's own per-step figure, TRL's the time between
``on_step_begin`` and ``on_step_end``); the median over steps. Beside it, CPU seconds per sample
(the median step's CPU time, from the second step on; ours counts the pool's processes too), which
other work on a shared machine moves less than the wall clock. Both run in this process, one after
the other, with the same torch threads; the first step's sampling is cold on both sides.

    .venv/bin/python benchmarks/rft_bench.py                                # 6 steps, K = 8, 16 tokens
    .venv/bin/python benchmarks/rft_bench.py --steps 10 --samples 4 --tokens 32

TRL is an optional extra: .venv/bin/python -m pip install -c constraints.txt ".[bench]"
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Before anything reads the configuration: the pool's ports (not bin/run's, nor the tests' or
# inference_bench's), and a scratch adapter folder, so nothing published here reaches another pool.
SCRATCH = Path(tempfile.mkdtemp(prefix="fineserve-rft-bench-"))
os.environ.setdefault("INFERENCE_POOL_URL", "http://127.0.0.1:38500")
os.environ.setdefault("FIRST_REPLICA_PORT", "38600")
os.environ["DYNAMIC_LORA_PATH"] = str(SCRATCH / "adapters")
os.environ["DATABASE_URL"] = f"sqlite:///{SCRATCH / 'bench.sqlite3'}"  # read by the configuration, never opened
os.environ.setdefault("DEBUG", "true")  # a local measurement: development mode, as bin/run starts it locally
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx
import psutil
import torch

from core.adapter_store import LocalAdapterStore
from core.config import load_config
from core.datasets import PromptItem, parse_dataset
from core.graders.engine import grade, sample_of
from core.loop_lora import LORA_ALPHA
from core.model_names import ModelName
from core.openai_protocol import BACKGROUND_HEADER, ORGANIZATION_HEADER
from tests.inference_fixtures import BASE, TARGET_MODULES
from tests.processes import answers, running, wait_until
from workers.training.model import build_lora_config
from workers.training_loop.reinforcement import Answer, Grade, ReinforcementConfig, RewardStep, train_by_reward

CONFIG = load_config()
WEIGHTS = CONFIG.data_dir / "models" / BASE
HEADERS = {"Authorization": f"Bearer {CONFIG.internal_token}", ORGANIZATION_HEADER: "rft-bench", BACKGROUND_HEADER: "1"}
SERVED = ModelName(BASE, "rft-bench")  # as PoolPolicy names a job's weights: not in any registry
GRADER = {"type": "text_similarity", "name": "says yes", "evaluation_metric": "fuzzy_match",
          "input": "{{sample.output_text}}", "reference": "{{item.reference_answer}}"}
PROMPTS_PER_STEP, LEARNING_RATE, KL_COEF, SEED = 4, 4e-4, 0.02, 42
QUESTIONS = [
    "Is the sky blue on a clear day?", "Is water wet?", "Do fish live in water?", "Is fire hot?",
    "Does the sun rise in the east?", "Is ice cold?", "Do birds have feathers?", "Is two more than one?",
    "Can people walk?", "Is snow white?", "Do trees have leaves?", "Is the ocean salty?",
    "Does a week have seven days?", "Is grass green?", "Do cats have four legs?", "Is Paris in France?",
]


def prompt_items() -> list[PromptItem]:
    """The questions as an uploaded prompts file's lines are read (the grader's item: the whole line)."""
    lines = [{"messages": [{"role": "user", "content": f"{q} Answer yes or no."}], "reference_answer": "Yes"}
             for q in QUESTIONS]
    return parse_dataset("\n".join(json.dumps(line) for line in lines).encode(), min_examples=1).examples


def score(item: dict, text: str) -> float:
    return grade(GRADER, item, sample_of(text)).score


class BenchPolicy:
    """PoolPolicy's work without Django: publish to the store the pool reads, sample from the pool."""

    base_model = BASE

    def __init__(self, pool_url: str) -> None:
        self._pool_url = pool_url
        self._store = LocalAdapterStore(Path(CONFIG.dynamic_lora_path))
        self._revision: int | None = None

    def serve(self, step: int, adapter_dir: Path) -> str:
        revision = step + 1  # as PoolPolicy: revisions from 1, step 0's weights are the base model's
        self._store.write_revision(str(SERVED), revision, adapter_dir)
        if self._revision is not None:  # the revision before has answered all it will
            self._store.delete(str(ModelName(BASE, SERVED.suffix, self._revision)))
        self._revision = revision
        return str(ModelName(BASE, SERVED.suffix, revision))

    def sample(
        self, model: str, prompts: list[list[int]], n: int, max_tokens: int, temperature: float, seed: int
    ) -> list[list[Answer]]:
        async def all_at_once() -> list[dict]:  # as the job's Answerer sends them: the engine batches them
            async with httpx.AsyncClient(timeout=600) as client:
                replies = await asyncio.gather(*(client.post(f"{self._pool_url}/v1/completions", headers=HEADERS, json={
                    "model": model, "prompt": prompt, "n": n, "max_tokens": max_tokens, "temperature": temperature,
                    "seed": seed + index, "logprobs": 0, "return_token_ids": True}) for index, prompt in enumerate(prompts)))
            return [reply.raise_for_status().json() for reply in replies]

        return [[Answer(c["text"], c["token_ids"], c["logprobs"]["token_logprobs"])
                 for c in sorted(reply["choices"], key=lambda c: c["index"])] for reply in asyncio.run(all_at_once())]

    def grade(self, items: list[dict], answers: list[str]) -> list[Grade]:
        return [Grade(reward, reward >= 1.0) for reward in map(score, items, answers)]


def cpu_seconds(processes: list[psutil.Process]) -> float:
    """The processes' CPU time so far (every thread's, user and system)."""
    return sum(sum(process.cpu_times()[:2]) for process in processes)


class Steps:
    """Our loop's callbacks: each step's figures kept, and the CPU time between two steps' ends."""

    def __init__(self) -> None:
        self.steps: list[RewardStep] = []
        self.processes: list[psutil.Process] = []  # this one and the pool's (the engine's included)
        self.cpu: list[float] = []
        self._cpu_before: float | None = None

    def on_step(self, metrics: RewardStep) -> None:
        self.steps.append(metrics)  # (printed: a run takes minutes)
        now = cpu_seconds(self.processes)
        if self._cpu_before is not None:  # the first step's start is inside the loop, past the model's loading
            self.cpu.append(now - self._cpu_before)
        self._cpu_before = now
        print(f"  ours step {metrics.step}: {metrics.samples_per_second:.2f} samples/s, reward {metrics.reward_mean:.3f}, "
              f"{metrics.seconds}", flush=True)

    def on_evaluation(self, total_steps: int, valid_reward: float, valid_pass_rate: float) -> None:
        pass

    def on_checkpoint(self, *args: Any) -> None:
        pass

    def should_stop(self) -> bool:
        return False


Side = tuple[list[float], list[float], list[float]]  # each step's seconds and CPU seconds, its answers' mean reward


def run_ours(args: argparse.Namespace) -> tuple[Side, dict[str, float]]:
    """Our loop against a pool started for it (and stopped before returning); also the median seconds by phase."""
    prompts = prompt_items()
    config = ReinforcementConfig(
        base_model_path=WEIGHTS, base_model_id=BASE, lora_r=8, seed=SEED, batch_size=PROMPTS_PER_STEP,
        n_epochs=math.ceil(args.steps * PROMPTS_PER_STEP / len(prompts)), samples_per_prompt=args.samples,
        max_completion_tokens=args.tokens, learning_rate=LEARNING_RATE, kl_coef=KL_COEF, eval_interval=10**6,
        max_steps=args.steps,
    )
    steps = Steps()
    with running("rft-bench-pool", [sys.executable, "-m", "inference"]) as pool:
        print("waiting for the pool's engine ...", flush=True)
        wait_until(lambda: answers(f"{CONFIG.inference_pool_url}/health", headers=HEADERS), 600, "pool", pool)
        root = psutil.Process(pool.pid)  # the pool, its replica's vLLM server and engine: what samples
        steps.processes = [psutil.Process(), root, *root.children(recursive=True)]
        train_by_reward(config, prompts, [], SCRATCH / "ours", BenchPolicy(CONFIG.inference_pool_url), steps)
    answered = PROMPTS_PER_STEP * args.samples
    phases = {phase: statistics.median(s.seconds.get(phase, 0.0) for s in steps.steps) for phase in ("serve", "sample", "grade", "train")}
    seconds = [answered / s.samples_per_second for s in steps.steps]
    return (seconds, steps.cpu, [s.reward_mean for s in steps.steps]), phases


def run_trl(args: argparse.Namespace) -> Side:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    seconds: list[float] = []
    cpu: list[float] = []
    rewards: list[float] = []
    this = [psutil.Process()]  # TRL samples and trains in this process

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.started, self.cpu = time.perf_counter(), cpu_seconds(this)

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            seconds.append(time.perf_counter() - self.started)
            if len(seconds) > 1:  # as ours: from the second step on
                cpu.append(cpu_seconds(this) - self.cpu)
            print(f"  TRL step {len(seconds)}: {answered / seconds[-1]:.2f} samples/s, reward {rewards[-1]:.3f}", flush=True)

    def says_yes(completions: list[list[dict]], reference_answer: list[str], **kwargs: Any) -> list[float]:
        # One call a step (a step is one generation batch): the answers are conversational, one message each.
        found = [score({"reference_answer": ref}, c[-1]["content"]) for c, ref in zip(completions, reference_answer)]
        rewards.append(statistics.mean(found))
        return found

    answered = PROMPTS_PER_STEP * args.samples
    records = [{"prompt": [{"role": m["role"], "content": m["content"]} for m in item.prompt],  # TRL knows no "weight"
                "reference_answer": item.item["reference_answer"]} for item in prompt_items()]
    config = GRPOConfig(
        output_dir=str(SCRATCH / "trl"), per_device_train_batch_size=answered, gradient_accumulation_steps=1,
        num_generations=args.samples, max_completion_length=args.tokens, temperature=1.0, learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant", beta=KL_COEF, loss_type="grpo", max_steps=args.steps, use_vllm=False,
        use_cpu=True, bf16=False, report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True, seed=SEED,
        model_init_kwargs={"dtype": torch.float32}, dataloader_num_workers=0,
    )
    lora = build_lora_config(8, LORA_ALPHA, 0.0, TARGET_MODULES)
    trainer = GRPOTrainer(model=str(WEIGHTS), reward_funcs=says_yes, args=config, peft_config=lora,
                          train_dataset=Dataset.from_list(records), callbacks=[StepTimer()])
    trainer.train()
    return seconds, cpu, rewards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="steps for each side (default 6)")
    parser.add_argument("--samples", type=int, default=8, help="K: answers sampled per prompt (default 8)")
    parser.add_argument("--tokens", type=int, default=16, help="M: most tokens an answer (default 16)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads for both (default 0: torch's own)")
    args = parser.parse_args()
    if importlib.util.find_spec("trl") is None:
        parser.exit(2, 'TRL\'s GRPOTrainer is the baseline, and TRL is not installed: .venv/bin/python -m pip install -c constraints.txt ".[bench]"\n')
    if args.threads:
        torch.set_num_threads(args.threads)
    answered = PROMPTS_PER_STEP * args.samples
    print(f"scratch: {SCRATCH}; {args.steps} steps of {PROMPTS_PER_STEP} prompts x {args.samples} answers, "
          f"<= {args.tokens} tokens; {torch.get_num_threads()} torch threads", flush=True)
    started = time.perf_counter()
    ours, phases = run_ours(args)  # the pool is stopped when this returns: TRL's run has the cores alone
    trl = run_trl(args)
    rows = {"ours (pool sampling + loop)": ours, "TRL GRPOTrainer + PEFT": trl}

    print()
    print(f"{'side':<30}{'steps':>6}{'samples/step':>13}{'median step s':>15}{'samples/s':>11}{'CPU s/sample':>14}"
          "   reward first -> last")
    for name, (seconds, cpu, rewards) in rows.items():
        step = statistics.median(seconds)
        print(f"{name:<30}{len(seconds):>6}{answered:>13}{step:>15.2f}{answered / step:>11.2f}"
              f"{statistics.median(cpu) / answered:>14.2f}   {rewards[0]:.3f} -> {rewards[-1]:.3f}")
    ratio = statistics.median(trl[0]) / statistics.median(ours[0])
    cpu_ratio = statistics.median(trl[1]) / statistics.median(ours[1])
    print(f"ours / TRL, samples/s: {ratio:.2f}x   (goal >= 2x: {'PASS' if ratio >= 2 else 'MISS'});  "
          f"TRL's CPU s/sample over ours: {cpu_ratio:.2f}x")
    print("  CPU: the median step's CPU time from the second step on; ours counts the pool's processes too")
    print("ours, median s by phase: " + ", ".join(f"{phase} {s:.2f}" for phase, s in phases.items()))
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} (other work included); "
          f"wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
