"""Batch lines for several adapters: answered in line order against grouped by adapter (what the
batch worker does, ``batches.line_answers.in_groups``).

    bin/run   # in another terminal: the platform, its database and its inference pool
    .venv/bin/python benchmarks/batch_bench.py [--organization NAME] [--lines 64] [--adapters 4] [--max-tokens 32]

On the running platform (its database and its pool, from the same environment ``bin/run`` uses), one
organization's fine-tuned models (the newest ``--adapters``; at least one) answer a batch whose lines
name them in turn (a, b, c, d, a, b, ...), as a file mixing models does. The lines are answered by the
batch worker's own code (``batches.line_answers.answered``: checks, access, the model's backend,
usage), ``LINES_AT_ONCE`` at a time, twice: in line order, then grouped by model (each group in line
order). It prints each order's wall time and tokens a second, and grouped's ratio to line order
measured in the same run. The answers count in the organization's usage as batch usage.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "platform")]
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "server.settings")

import django

django.setup()

from accounts.models import Organization
from answering.batch import Answerer
from batches import line_answers
from batches.models import BatchResult
from core.batch_input import BatchRequest
from finetuning.models import FineTunedModel
from workers.run_batch import LINES_AT_ONCE

QUESTIONS = ("What is the capital of France?", "Name three colours.", "Count to five.", "Say hello politely.")


def batch_lines(models: list[str], count: int, max_tokens: int) -> list[BatchRequest]:
    """``count`` lines naming ``models`` in turn: the worst order for adapter swaps."""
    return [
        BatchRequest(
            n + 1, f"line-{n}", "/v1/chat/completions",
            {"model": models[n % len(models)], "max_tokens": max_tokens, "temperature": 0,
             "messages": [{"role": "user", "content": QUESTIONS[n % len(QUESTIONS)]}]},
        )
        for n in range(count)
    ]


def timed(organization: Organization, groups: list[list[BatchRequest]]) -> tuple[float, int, int]:
    """Wall seconds, output tokens and failed lines for answering ``groups`` one after the other,
    ``LINES_AT_ONCE`` lines at a time, as the batch worker does."""
    access = line_answers.Access(organization)
    tokens = failed = 0
    started = time.perf_counter()
    with Answerer(organization.pk) as answerer:
        for group in groups:
            for start in range(0, len(group), LINES_AT_ONCE):
                results: list[BatchResult] = line_answers.answered(
                    answerer, access, group[start : start + LINES_AT_ONCE], "bench"
                )
                tokens += sum(result.output_tokens for result in results)
                failed += sum(not result.ok for result in results)
    return time.perf_counter() - started, tokens, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--organization", default="Demo", help="whose fine-tuned models answer (by name)")
    parser.add_argument("--lines", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    organization = Organization.objects.filter(name=args.organization).first()
    if organization is None:
        sys.exit(f"No organization named {args.organization!r}: pass --organization (bin/run makes 'Demo').")
    models = list(
        FineTunedModel.objects.filter(organization=organization)
        .order_by("-created_at")
        .values_list("name", flat=True)[: args.adapters]
    )
    if not models:
        sys.exit(f"{organization.name} has no fine-tuned model: train or upload one first (README, five minutes).")
    lines = batch_lines(models, args.lines, args.max_tokens)
    print(f"{len(lines)} lines over {len(models)} adapter(s): {', '.join(models)}; {LINES_AT_ONCE} lines at a time")

    timed(organization, [lines[: len(models)]])  # warm: every adapter loaded once before either order is timed
    in_line_order = [lines]
    grouped = line_answers.in_groups(lines)
    results = {}
    for name, groups in (("line order", in_line_order), ("grouped by adapter", grouped)):
        seconds, tokens, failed = timed(organization, groups)
        results[name] = seconds
        note = f", {failed} failed" if failed else ""
        print(f"{name:20} {seconds:8.2f} s  {tokens / seconds:8.1f} output tok/s{note}")
    print(f"grouped / line order: {results['grouped by adapter'] / results['line order']:.2f} of the time")


if __name__ == "__main__":
    main()
