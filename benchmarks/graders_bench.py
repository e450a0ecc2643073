"""What grading costs: one sample graded by each grader type ``core.graders`` runs without a judge,
in microseconds, against ``string_check`` (the cheapest) in the same run, for a short answer and a
long one. An eval run grades every item with every criterion, and RFT grades every sample it
draws, so this is the cost that multiplies.

    .venv/bin/python benchmarks/graders_bench.py [--samples 200]

The answers are English sentences (a short one of 12 words, a long one of about 2,000 characters,
near what MAX_COMPLETION_TOKENS allows); the reference is a reworded copy, so every metric has
work to do. Model graders are left out: their cost is the judge's answer (a chat completion), which
``benchmarks/inference_bench.py`` measures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.graders.engine import grade, sample_of  # noqa: E402 (after the path)
from core.graders.similarity import METRICS  # noqa: E402

SHORT = "The capital of France is Paris, a city on the Seine in the north."
SHORT_REFERENCE = "Paris, on the river Seine in northern France, is the capital of France."
LONG = " ".join([SHORT] * 30)
LONG_REFERENCE = " ".join([SHORT_REFERENCE] * 30)


def graders() -> dict[str, dict]:
    text = {"input": "{{sample.output_text}}", "reference": "{{item.reference}}"}
    found = {"string_check": {"type": "string_check", "name": "s", "operation": "ilike", **text}}
    for metric in METRICS:
        found[f"text_similarity {metric}"] = {"type": "text_similarity", "name": "t", "evaluation_metric": metric, **text}
    found["multi (string_check + rouge_l)"] = {
        "type": "multi", "name": "m", "calculate_output": "0.5 * exact + 0.5 * close",
        "graders": {"exact": found["string_check"], "close": found["text_similarity rouge_l"]},
    }
    return found


def microseconds(grader: dict, answer: str, reference: str, samples: int) -> float:
    """The median of ``samples`` gradings, each timed on its own (the libraries' first call, which
    imports them, is left out)."""
    item, sample = {"reference": reference}, sample_of(answer)
    grade(grader, item, sample)
    times = []
    for _ in range(samples):
        started = time.perf_counter()
        grade(grader, item, sample)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args()
    rows = []
    for name, grader in graders().items():
        rows.append((name, microseconds(grader, SHORT, SHORT_REFERENCE, args.samples),
                     microseconds(grader, LONG, LONG_REFERENCE, max(args.samples // 10, 5))))
    baseline_short, baseline_long = rows[0][1], rows[0][2]
    print(f"{'grader':34} {'short µs':>10} {'× string_check':>15} {'long µs':>10} {'× string_check':>15}")
    for name, short, long in rows:
        print(f"{name:34} {short:10.1f} {short / baseline_short:15.1f} {long:10.1f} {long / baseline_long:15.1f}")


if __name__ == "__main__":
    main()
