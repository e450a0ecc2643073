"""A reinforcement fine-tuning job on a worker: the loop (``workers.training_loop.reinforcement``) given
the pool's side, and its progress as the job's events and checkpoints.

- The weights of each step are written as a revision of a name of the job's own
  (``<base>:rft-<job>@r<step>``, not in the registry: nobody else can ask for it), which the pool loads
  on its first request; the revision before is dropped once the new one answers.
- Answers are sampled as completions of the prompt's tokens, as background work counted in the
  organization's usage, each token with its id and log-probability (``return_token_ids``, ``logprobs``).
- The job's grader scores them as an eval run's graders do (``workers.scoring.Grading``: judges asked
  in batches, through the same pool).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from answering.batch import Answerer, refusal_words
from core.datasets import PromptItem
from core.eval_items import EvalItem
from core.graders.engine import sample_of
from core.grading import GradingSandbox
from core.model_names import ModelName
from finetuning import job_creation, publishing
from finetuning.models import FineTuningJob, record_event
from workers.db_retry import retrying
from workers.scoring import Grading

if TYPE_CHECKING:  # torch: imported only when a job trains
    from workers.training import TrainingResult
    from workers.training_loop.reinforcement import Answer, Grade, ReinforcementCallbacks, RewardStep

COMPLETIONS = "completions"


class PoolRefused(Exception):
    """The pool did not answer a sampling request: the job fails naming why."""


class PoolPolicy:
    """The serving pool's side of a reinforcement job (``reinforcement.Policy``)."""

    def __init__(self, job: FineTuningJob, answerer: Answerer, sandbox: GradingSandbox):
        self.base_model = job.model
        self.served = ModelName(job.model, "rft-" + job.pk.partition("-")[2].lower())
        self._store = publishing.store_for(job.model)
        self._answerer = answerer
        self._grading = Grading(answerer, sandbox)
        assert job.grader is not None  # a reinforcement job is created with one (``finetuning.job_creation``)
        self._grader = job.grader
        self._revision: int | None = None

    def serve(self, step: int, adapter_dir: Path) -> str:
        revision = step + 1  # revisions count from 1; step 0's weights are the base model's
        self._store.write_revision(str(self.served), revision, adapter_dir)
        self.withdraw()  # the last revision's answers are all in: sampling waits for them
        self._revision = revision
        return str(ModelName(self.served.base_model_id, self.served.suffix, revision))

    def withdraw(self) -> None:
        """Drop the revision served last (at the end: the job's own adapter is published apart)."""
        if self._revision is not None:
            self._store.delete(str(ModelName(self.served.base_model_id, self.served.suffix, self._revision)))
            self._revision = None

    def sample(self, model: str, prompts: list[list[int]], n: int, max_tokens: int, temperature: float, seed: int) -> list[list[Answer]]:
        from workers.training_loop.reinforcement import Answer

        bodies = [_completion_body(model, prompt, n, max_tokens, temperature, seed + index) for index, prompt in enumerate(prompts)]
        groups = []
        for reply in self._answerer.send([(COMPLETIONS, body) for body in bodies]):
            if reply.status != 200:
                _code, message = refusal_words(reply.status, reply.body)
                raise PoolRefused(f"the serving pool refused to sample ({reply.status}): {message}")
            choices = sorted(json.loads(reply.body)["choices"], key=lambda choice: choice["index"])
            groups.append([Answer(choice["text"], choice["token_ids"], choice["logprobs"]["token_logprobs"]) for choice in choices])
        return groups

    def grade(self, items: list[dict], answers: list[str]) -> list[Grade]:
        from workers.training_loop.reinforcement import Grade

        graded = [(EvalItem(item), sample_of(answer)) for item, answer in zip(items, answers)]
        results = [criteria[0] for criteria in self._grading.results_of([self._grader], graded)]
        full_marks = _full_marks(self._grader)
        return [Grade(r.score, r.passed if r.passed is not None else r.score >= full_marks - 1e-9) for r in results]


def _completion_body(model: str, prompt: list[int], n: int, max_tokens: int, temperature: float, seed: int) -> bytes:
    body = {
        "model": model, "prompt": prompt, "n": n, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
        "logprobs": 0, "return_token_ids": True,
    }
    return json.dumps(body).encode()


def _full_marks(grader: dict) -> float:
    """The score a perfect answer gets: a score_model's range's top, 1 for the others."""
    return float(grader.get("range", [0, 1])[1]) if grader["type"] == "score_model" else 1.0


def reward_data(metrics: RewardStep) -> dict[str, Any]:
    """A step's metrics as its event's data (the job page's chart reads them)."""
    data: dict[str, Any] = {
        "step": metrics.step, "total_steps": metrics.total_steps, "epoch": metrics.epoch,
        "reward_mean": metrics.reward_mean, "reward_std": metrics.reward_std, "pass_rate": metrics.pass_rate,
        "kl": metrics.kl, "answer_tokens": metrics.answer_tokens, "samples_per_second": metrics.samples_per_second,
        "trained_tokens": metrics.trained_tokens, "seconds": metrics.seconds,
    }
    if metrics.valid_reward is not None:
        data |= {"valid_reward": metrics.valid_reward, "valid_pass_rate": metrics.valid_pass_rate}
    return data


def reward_message(metrics: RewardStep) -> str:
    message = (
        f"Step {metrics.step}/{metrics.total_steps}: reward mean={metrics.reward_mean:.4f}, std={metrics.reward_std:.4f}, "
        f"pass rate={metrics.pass_rate:.2f}, KL to base={metrics.kl:.4f}"
    )
    if metrics.valid_reward is not None:
        message += f", validation reward={metrics.valid_reward:.4f}"
    return message


def record_base_evaluation(job: FineTuningJob, total_steps: int, valid_reward: float, valid_pass_rate: float) -> None:
    """The validation prompts' reward before training: the base model's, where the chart starts."""
    message = f"Before training: validation reward={valid_reward:.4f}, pass rate={valid_pass_rate:.2f} (the base model's answers)"
    data = {"step": 0, "total_steps": total_steps, "epoch": 0, "trained_tokens": 0,
            "valid_reward": valid_reward, "valid_pass_rate": valid_pass_rate}
    retrying(record_event, job, message, data=data)


def train_by_reward(
    job: FineTuningJob, base_weights: Path, prompts: list[PromptItem], validation: list[PromptItem], workdir: Path,
    callbacks: ReinforcementCallbacks,
) -> TrainingResult:
    """Train ``job`` (a reinforcement one) on its prompts; the result as a supervised run's is."""
    from workers.training_loop.reinforcement import ReinforcementConfig
    from workers.training_loop.reinforcement import train_by_reward as train

    hp = job.hyperparameters
    early_stopping = hp.get("early_stopping") or {}
    config = ReinforcementConfig(
        base_model_path=base_weights, base_model_id=job.model, lora_r=hp["lora_r"], seed=job.seed,
        n_epochs=hp["n_epochs"], batch_size=hp["batch_size"], samples_per_prompt=hp["samples_per_prompt"],
        learning_rate=job_creation.BASE_LEARNING_RATE * hp["learning_rate_multiplier"],
        eval_interval=hp["eval_interval"], eval_samples=hp["eval_samples"],
        max_completion_tokens=hp["max_completion_tokens"],
        early_stopping_patience=early_stopping.get("patience"), early_stopping_min_delta=early_stopping.get("min_delta", 0.0),
    )
    with Answerer(job.organization_id) as answerer, GradingSandbox() as sandbox:
        policy = PoolPolicy(job, answerer, sandbox)
        try:
            return train(config, prompts, validation, workdir, policy, callbacks)
        finally:
            policy.withdraw()
