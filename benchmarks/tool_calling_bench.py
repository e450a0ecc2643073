"""Function-calling fine-tune: how often the model calls the tool with the right argument for prompts
no training line resembles, the base model against its fine-tune on 40 lines of OpenAI's format.

    .venv/bin/python benchmarks/tool_calling_bench.py [--lines 40] [--epochs 2] [--batch-size 4]
                                                      [--learning-rate 2e-3] [--rank 16] [--dropout 0]
                                                      [--cities N]

Trains with the platform's trainer on ``tests.tool_calling.weather_dataset(lines)`` (one tool, a city its
argument), then asks every held-out city (``HELD_OUT_CITIES``: none in a training line, in phrasings
no training line uses) greedily, the tools in the prompt as the engine renders them, with the tool
choice left to the model (``auto``): a reply is right when it parses, as vLLM's hermes parser reads
it, to exactly one call of get_weather with that city. The same prompts to the base model are the
baseline (``--cities 20``: the product test's sample of them). Generation here is PEFT's in float32, token for token the prompt the server renders
(tests/test_tools_served.py); the product test asks the served model a fixed sample of the cities.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402 (after the path)
from peft import PeftModel  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase  # noqa: E402

from core.chat_tokens import load_tokenizer, render  # noqa: E402
from core.datasets import parse_example  # noqa: E402
from tests.tool_calling import WEATHER_TOOL, held_out_prompts, weather_dataset  # noqa: E402
from workers.training import TrainingConfig, train  # noqa: E402

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
WEIGHTS = ROOT / "data" / "models" / BASE
CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


class _Quiet:
    def on_step(self, metrics) -> None: ...

    def on_checkpoint(self, *args) -> None: ...

    def should_stop(self) -> bool:
        return False


def calls(reply: str) -> list[tuple[str, object]]:
    """The calls in a reply, read as the hermes parser reads them: JSON between <tool_call> tags."""
    found = []
    for text in CALL.findall(reply):
        try:
            call = json.loads(text)
        except ValueError:
            continue
        if isinstance(call, dict):
            found.append((call.get("name"), call.get("arguments")))
    return found


def right_calls(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, cities: int | None) -> tuple[int, list[str]]:
    """How many held-out cities the model calls get_weather for, exactly, and the replies that missed."""
    right, missed = 0, []
    for question, city in held_out_prompts(cities):
        prompt = render(tokenizer, [{"role": "user", "content": question}], [WEATHER_TOOL], add_generation_prompt=True)
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            output = model.generate(**ids, max_new_tokens=40, do_sample=False)
        reply = tokenizer.decode(output[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        if calls(reply) == [("get_weather", {"city": city})]:
            right += 1
        else:
            missed.append(f"{city}: {reply[:70]!r}")
    return right, missed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=40)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=2e-3)  # the docs' multiplier of 10
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--cities", type=int, default=None, help="held-out cities asked (default: all)")
    args = parser.parse_args()

    records = [parse_example(line)[0] for line in weather_dataset(args.lines).decode().splitlines()]
    config = TrainingConfig(
        base_model_path=WEIGHTS, base_model_id=BASE, n_epochs=args.epochs, batch_size=args.batch_size,
        learning_rate=args.learning_rate, lora_r=args.rank, lora_alpha=2 * args.rank, lora_dropout=args.dropout,
    )
    tokenizer = load_tokenizer(WEIGHTS)
    base = AutoModelForCausalLM.from_pretrained(WEIGHTS, dtype=torch.float32).eval()
    base_right, _ = right_calls(base, tokenizer, args.cities)
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        result = train(config, records, None, Path(folder), _Quiet())
        trained_s = time.perf_counter() - started
        tuned = PeftModel.from_pretrained(base, result.adapter_dir).eval()
        tuned_right, missed = right_calls(tuned, tokenizer, args.cities)

    total = len(held_out_prompts(args.cities))
    print(f"function calling on {total} held-out cities, tool_choice auto ({args.lines} training lines x {args.epochs} "
          f"epochs, {result.steps} steps, {trained_s:.0f} s to train)")
    print(f"    {'model':<12}{'right':>8}{'share':>8}")
    print(f"    {'base':<12}{base_right:>8}{base_right / total:>8.0%}")
    print(f"    {'fine-tune':<12}{tuned_right:>8}{tuned_right / total:>8.0%}")
    print("missed by the fine-tune:")
    for line in missed:
        print(f"    {line}")


if __name__ == "__main__":
    main()
