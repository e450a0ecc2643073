"""The LoRA step of one engine step, without an engine: our CPU kernels against vLLM's own.

    .venv/bin/python benchmarks/lora_kernels_replay.py [--steps 10] [--slots 32] [--rank 8] [--beside-base]

Replays what a replica's LoRA layers do in one step on the catalog's default base model: every
adapted projection (q/k/v, o, gate/up, down, per layer; the shapes read from the model's
config.json), for batches of decode and prefill tokens spread over the adapter slots, through
vLLM's ``update_metadata`` and ``add_lora_linear`` and through ours (``inference.engine``),
both of them: torch's batched products, and the C kernel with adapter weights in half precision
(``inference.engine.gemv``), which replicas run where it builds. It prints milliseconds of LoRA per
step for each, and vLLM's time over the C kernel's. The engine's own profile puts
these steps' LoRA at about a quarter of a decode step with 32 adapters in one batch
(docs/lora-kernels.md); this is where to make it cheaper, seconds per try instead of minutes.
``--beside-base`` runs each projection's base product (the batch times a float32 weight of the
base layer's shape) before its LoRA, as an engine does, and still times the LoRA alone: the base
products push the adapter weights out of the caches, so this is the LoRA's cost inside a step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "platform")]

import torch  # noqa: E402

from core.config import configured_data_dir, load_config  # noqa: E402
from inference.engine import gemv as c_kernel  # noqa: E402
from inference.engine import replacements, state  # noqa: E402
from inference.engine.check import updated_wrapper  # noqa: E402

MAX_RANK = 16  # the catalog's max_lora_rank: vLLM pads every adapter to it


def projections(config: dict) -> list[tuple[int, tuple[int, ...]]]:
    """(input size, output slices) of each adapted projection, in the order a step runs them."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    head = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    layer = [(hidden, (q, kv, kv)), (q, (hidden,)), (hidden, (inner, inner)), (inner, (hidden,))]
    return layer * config["num_hidden_layers"]


def stacked(slots: int, rank: int, fan_in: int, outs: tuple[int, ...]) -> tuple[tuple, tuple]:
    lora_a = tuple(torch.zeros(slots, 1, MAX_RANK, fan_in) for _ in outs)
    lora_b = tuple(torch.zeros(slots, 1, out, MAX_RANK) for out in outs)
    for a, b in zip(lora_a, lora_b):
        a[:, :, :rank].normal_(std=0.02)
        b[:, :, :, :rank].normal_(std=0.02)
    return lora_a, lora_b


def batches(slots: int) -> dict[str, tuple[list[int], bool]]:
    """Each token's slot, and whether vLLM sees a prefill, for the batches a busy replica runs."""
    return {
        f"decode, 32 tokens over {slots} slots": ([t % slots for t in range(32)], False),
        "decode, 32 tokens over 4 slots": ([t % 4 for t in range(32)], False),
        "decode, 32 tokens, 1 slot": ([0] * 32, False),
        f"31 decoding + a 12-token prompt, {slots} slots": ([t % slots for t in range(31)] + [31 % slots] * 12, True),
        f"prefill burst, 32 prompts x 12 tokens, {slots} slots": ([p % slots for p in range(32) for _ in range(12)], True),
    }


def time_step(
    wrapper: object, layers: list, inputs: list[torch.Tensor], steps: int, base_weights: list[torch.Tensor] | None
) -> float:
    """Median milliseconds of one step's LoRA: every projection once, each after its base product
    (untimed) when ``base_weights`` holds the base layers' weights."""
    outputs = [torch.zeros(x.size(0), sum(outs)) for x, (_, outs, _, _) in zip(inputs, layers)]
    samples = []
    for _ in range(steps + 2):  # two warm-up steps: our kernels prepare their weights in the first
        lora = 0.0
        for index, (x, y, (_, outs, lora_a, lora_b)) in enumerate(zip(inputs, outputs, layers)):
            if base_weights:
                torch.mm(x, base_weights[index], out=y)
            started = time.perf_counter()
            wrapper.add_lora_linear(y, x, lora_a, lora_b, 1.0, outs)
            lora += time.perf_counter() - started
        samples.append(lora)
    return statistics.median(samples[2:]) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--slots", type=int, default=32, help="adapter slots (the catalog's max_loras)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--beside-base", action="store_true", help="each projection's base product before its LoRA")
    args = parser.parse_args()
    torch.manual_seed(0)
    base = load_config().catalog().models[0]
    config = json.loads((Path(base.weights) / "config.json").read_text())
    layers = [(fan_in, outs, *stacked(args.slots, args.rank, fan_in, outs)) for fan_in, outs in projections(config)]
    lora_ids: list[int | None] = list(range(9001, 9001 + args.slots))
    state.RANKS.update(dict.fromkeys(lora_ids, args.rank))
    stock_class = replacements.vllm_class(replacements.PUNICA_CPU)
    ours = replacements.resolve([replacements.When.KERNELS])
    gemv = c_kernel.load(configured_data_dir() / "build")
    classes = {
        "vLLM": stock_class,
        "products": replacements.checked_copy(stock_class, ours, None),
        "C kernel": replacements.checked_copy(stock_class, ours, gemv),
    }
    print(f"{base.id}: {len(layers)} adapted projections, {args.slots} slots, rank {args.rank} (max {MAX_RANK}), "
          f"{torch.get_num_threads()} threads; ms of LoRA per step, median of {args.steps}"
          f"{', each projection after its base product' if args.beside_base else ''}")
    base_weights = [torch.randn(fan_in, sum(outs)) for fan_in, outs, *_ in layers] if args.beside_base else None
    print(f"    {'batch':<50}" + "".join(f"{name:>10}" for name in classes) + f"{'vLLM/C':>8}")
    for label, (slot_of_token, is_prefill) in batches(args.slots).items():
        inputs = [torch.randn(len(slot_of_token), fan_in) for fan_in, *_ in layers]
        times = [
            time_step(
                updated_wrapper(wrapper_class, slot_of_token, lora_ids, is_prefill), layers, inputs, args.steps, base_weights
            )
            for wrapper_class in classes.values()
        ]
        print(f"    {label:<50}" + "".join(f"{ms:10.1f}" for ms in times) + f"{times[0] / times[-1]:7.1f}x")
    print(f"    a slot swap into the C kernel's layout, every projection: {slot_swap_ms(gemv, layers, args):.2f} ms")
    return 0


def slot_swap_ms(gemv: c_kernel.LoraGemv, layers: list, args: argparse.Namespace) -> float:
    """What one adapter put into a slot costs the C kernel (``HalfWeights.copy_slots``), median of steps."""
    state = tuple((lora_id, 0) for lora_id in range(args.slots))
    prepared = [gemv.prepare(lora_a, lora_b, args.rank, state) for _, _, lora_a, lora_b in layers]
    samples = []
    for step in range(args.steps):
        started = time.perf_counter()
        for weights in prepared:
            weights.copy_slots([step % args.slots])
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


if __name__ == "__main__":
    sys.exit(main())
