"""Mixes on a real engine, the same cases on either backend: a mix answers as PEFT does with the
same adapters merged at the same scales, computed in the kernel (so ranks may sum past
max_lora_rank), and mixed, scaled and plain requests share batches, each with its own answer.

Each case takes the persona calling the backend's gateway and the ``make_adapter`` fixture; the
pool's module (tests/test_inference_adapter_mix.py) and Ray's (tests/test_ray_backend.py) run them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import openai

from tests.inference_fixtures import BASE, Persona, publish_fine_tuned_model
from tests.processes import ROOT
from tests.served_answers import QUESTION, _suffix

TOKENS = 16


def chat(client: openai.OpenAI, model: str = BASE, adapters: list | None = None):
    extra = {"extra_body": {"adapters": adapters}} if adapters is not None else {}
    return client.chat.completions.create(model=model, messages=QUESTION, max_tokens=TOKENS, temperature=0, **extra)


def ask(client: openai.OpenAI, model: str = BASE, adapters: list | None = None) -> str:
    return chat(client, model, adapters).choices[0].message.content


def peft_mix_answer(folders: list[Path], scales: list[float]) -> str:
    """The greedy answer of the base model in PEFT with these adapters merged at these scales
    (``add_weighted_adapter``, ``combination_type="cat"``: the exact sum of the scaled deltas)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights = ROOT / "data" / "models" / BASE
    tokenizer = AutoTokenizer.from_pretrained(weights)
    base = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, folders[0], adapter_name="part0")
    for index, folder in enumerate(folders[1:], start=1):
        model.load_adapter(folder, adapter_name=f"part{index}")
    names = [f"part{index}" for index in range(len(folders))]
    model.add_weighted_adapter(names, scales, adapter_name="mix", combination_type="cat")
    model.set_adapter("mix")
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = model.generate(**prompt, max_new_tokens=TOKENS, do_sample=False)
    return tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)


def a_half_and_half_mix_answers_as_peft(persona: Persona, make_adapter: Callable[..., Path]) -> None:
    # Seeds 2 and 9: their half-and-half mix answers unlike the base model and unlike either alone,
    # so a wrong scale, a part left out or a mixed-up alpha shows as different text.
    folders = [make_adapter(seed=2), make_adapter(seed=9)]
    first, second = (publish_fine_tuned_model(persona, _suffix(f"half{i}"), folder) for i, folder in enumerate(folders))
    answer = chat(persona.client, adapters=[{"model": first, "scale": 0.5}, {"model": second, "scale": 0.5}])
    served = answer.choices[0].message.content
    assert answer.model.startswith(f"{BASE}:mix.")
    assert served == peft_mix_answer(folders, [0.5, 0.5])
    assert served not in (ask(persona.client), ask(persona.client, first), ask(persona.client, second))


def a_wide_mix_and_a_scale_alone_answer_as_peft(persona: Persona, make_adapter: Callable[..., Path]) -> None:
    """The kernel adds each part at its scale: nothing is built, so the parts' ranks (8 + 16) may sum
    past max_lora_rank (16), where a built adapter was refused; a negative scale and one adapter at a
    scale of its own are as exact."""
    folders = [make_adapter(seed=2), make_adapter(seed=42, rank=16)]
    first, second = (publish_fine_tuned_model(persona, _suffix(f"wide{i}"), folder) for i, folder in enumerate(folders))
    mixed = ask(persona.client, adapters=[{"model": first, "scale": 1.5}, {"model": second, "scale": -0.5}])
    assert mixed == peft_mix_answer(folders, [1.5, -0.5])
    scaled = ask(persona.client, adapters=[{"model": second, "scale": 1.75}])
    assert scaled == peft_mix_answer(folders[1:], [1.75])
    assert len({mixed, scaled, ask(persona.client, second), ask(persona.client)}) == 4


def mixed_scaled_and_plain_requests_in_one_batch_get_their_own_answers(
    persona: Persona, make_adapter: Callable[..., Path]
) -> None:
    first = publish_fine_tuned_model(persona, _suffix("batch-a"), make_adapter(seed=2))
    second = publish_fine_tuned_model(persona, _suffix("batch-b"), make_adapter(seed=9))
    requests = {
        "plain": (first, None),
        "scaled": (BASE, [{"model": first, "scale": 0.5}]),
        "mixed": (BASE, [{"model": first, "scale": 0.5}, {"model": second, "scale": 0.5}]),
        "base": (BASE, None),
    }
    alone = {label: ask(persona.client, model, adapters) for label, (model, adapters) in requests.items()}
    assert len(set(alone.values())) == 4  # four different answers, so a mix-up would show
    together: dict[str, str] = {}

    def ask_for(label: str) -> None:
        together[label] = ask(persona.client, *requests[label])

    threads = [threading.Thread(target=ask_for, args=(label,)) for label in requests for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert together == alone
