"""A succeeded job's result file, as OpenAI's jobs have one: its per-step metrics as CSV, a File of
purpose ``fine-tune-results`` (listed in ``result_files``, read with ``GET /v1/files/{id}/content``)."""

from __future__ import annotations

import csv
import io

from finetuning import storage
from finetuning.models import DPO, REINFORCEMENT, File, FineTuningJob

PURPOSE = "fine-tune-results"
COLUMNS = ("step", "epoch", "train_loss", "valid_loss", "trained_tokens", "tokens_per_second")
# A DPO job's steps also say how far apart its pairs' answers are scored (``workers.training.preference_loss``).
PREFERENCE_COLUMNS = (*COLUMNS, "reward_margin", "preference_accuracy")
# A reinforcement job's steps are scored answers, not a loss (``workers.run_reinforcement.reward_data``);
# step 0 is the base model's validation reward.
REWARD_COLUMNS = (
    "step", "epoch", "reward_mean", "reward_std", "pass_rate", "valid_reward", "valid_pass_rate", "kl", "answer_tokens",
    "samples_per_second", "trained_tokens",
)


def columns_of(job: FineTuningJob) -> tuple[str, ...]:
    return {DPO: PREFERENCE_COLUMNS, REINFORCEMENT: REWARD_COLUMNS}.get(job.method, COLUMNS)


def metrics_csv(job: FineTuningJob) -> bytes:
    """One row a step, from the job's metrics events. A resumed job trained some steps twice (after
    its last checkpoint): the later attempt's row is the one its adapter comes from."""
    rows: dict[int, dict] = {}
    for data in job.events.filter(type="metrics").order_by("created_at", "pk").values_list("data", flat=True):
        if data and "step" in data:  # an evaluation's scores are metrics too, of no step
            rows[data["step"]] = data
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    columns = columns_of(job)
    writer.writerow(columns)
    for step in sorted(rows):
        writer.writerow(["" if rows[step].get(column) is None else rows[step][column] for column in columns])
    return out.getvalue().encode()


def store_results_file(job: FineTuningJob) -> File:
    """Write the CSV to the file store; the File row is saved by whoever marks the job succeeded,
    in the same transaction (``finetuning.job_status.succeed``), so a job that loses the race leaves
    only bytes, which it deletes (``discard``)."""
    data = metrics_csv(job)
    file = File(
        organization_id=job.organization_id, filename=f"{job.id}-results.csv", purpose=PURPOSE, bytes=len(data),
        example_count=0, token_count=0, max_example_tokens=0,
    )
    file.storage_key = f"files/{job.organization_id}/{file.id}.csv"
    storage.files().put(file.storage_key, data)
    return file


def discard(file: File) -> None:
    storage.files().delete_prefix(file.storage_key)
