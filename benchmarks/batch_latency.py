"""Live chat latency with and without a batch running, on the running platform.

    bin/run   # in another terminal
    .venv/bin/python benchmarks/batch_latency.py --url http://127.0.0.1:8000 --api-key sk-... [--samples 30] [--lines 192]

With the official ``openai`` client, as a user: ``--samples`` live chat requests of the base model
(16 tokens, one at a time, two in flight) with nothing else running; then a batch of ``--lines``
chat requests (64 tokens each) is created, and the same live requests are sent while it runs. It
prints p50 and p99 of the live requests' latency for each, their ratio (measured in the same run),
and how long the batch took. The batch runs on its own queue and worker (``batcher``), a few lines
at a time (``workers.run_batch.LINES_AT_ONCE``), so live requests share the engine with those only.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def live_latencies(client: openai.OpenAI, samples: int) -> list[float]:
    """Seconds each of ``samples`` live requests took, two in flight."""

    def one(_: int) -> float:
        started = time.perf_counter()
        client.chat.completions.create(model=BASE, messages=QUESTION, max_tokens=16, temperature=0)
        return time.perf_counter() - started

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, range(samples)))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the web process, as bin/run prints it")
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--lines", type=int, default=192)
    args = parser.parse_args()
    client = openai.OpenAI(base_url=f"{args.url}/v1", api_key=args.api_key, max_retries=0, timeout=300)

    live_latencies(client, 4)  # warm
    alone = live_latencies(client, args.samples)
    lines = [
        {"custom_id": f"line-{n}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": BASE, "messages": [{"role": "user", "content": f"Write a story about the number {n}."}],
                  "max_tokens": 64, "min_tokens": 64, "temperature": 0.8}}
        for n in range(args.lines)
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines).encode()
    batch_file = client.files.create(file=("latency.jsonl", io.BytesIO(text)), purpose="batch")
    started = time.perf_counter()
    batch = client.batches.create(input_file_id=batch_file.id, endpoint="/v1/chat/completions", completion_window="24h")
    while client.batches.retrieve(batch.id).request_counts.completed < 8:  # under way
        time.sleep(0.2)
    beside = live_latencies(client, args.samples)
    still_running = client.batches.retrieve(batch.id).status == "in_progress"
    while (done := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(1)
    batch_s = time.perf_counter() - started

    print(f"live chat latency, {args.samples} requests of 16 tokens, two in flight (s)")
    print(f"    {'':<28}{'p50':>8}{'p99':>8}")
    for label, values in (("alone", alone), (f"beside a {args.lines}-line batch", beside)):
        print(f"    {label:<28}{statistics.median(values):8.3f}{percentile(values, 0.99):8.3f}")
    print(f"    ratio (beside / alone)      {statistics.median(beside) / statistics.median(alone):8.2f}"
          f"{percentile(beside, 0.99) / percentile(alone, 0.99):8.2f}")
    print(f"the batch: {done.status}, {done.request_counts.completed} of {done.request_counts.total} lines in "
          f"{batch_s:.0f} s{'' if still_running else ' (it finished before the live requests did)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
