"""What the engine tests ask the served models, and what their answers are held to: PEFT's greedy
answer with the same weights, the usage API's count, the trainer's tokens of a tool conversation."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import openai

from core.chat_tokens import load_tokenizer, tokenize_example
from core.datasets import parse_example
from tests.inference_fixtures import BASE, internal_headers
from tests.processes import ROOT
from tests.tool_calling import weather_line

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


# A JSON schema a small model's free answer would not follow by chance.
PLACE_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "place",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "country": {"type": "string", "maxLength": 24}},
            "required": ["city", "country"],
            "additionalProperties": False,
        },
    },
}


def _suffix(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex[:8]}"


def _ask(client: openai.OpenAI, model: str, max_tokens: int = 24, **extra) -> str:
    answer = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=max_tokens, temperature=0, **extra
    )
    return answer.choices[0].message.content


def _peft_answer(adapter: Path, max_tokens: int) -> str:
    """The greedy answer of the base model with this adapter in PEFT, as training evaluates it."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights = ROOT / "data" / "models" / BASE
    tokenizer = AutoTokenizer.from_pretrained(weights)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32), adapter)
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = model.generate(**prompt, max_new_tokens=max_tokens, do_sample=False)
    return tokenizer.decode(output[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)


def usage_reported(gateway: str, api_key: str, started: int, requests: int) -> dict | None:
    """The usage API's one result (by model) since ``started``, once it counts ``requests``."""
    page = httpx.get(
        f"{gateway}/v1/organization/usage/completions",
        params={"start_time": started, "bucket_width": "1d", "group_by": "model"},
        headers={"Authorization": f"Bearer {api_key}"},
    ).json()
    results = [result for bucket in page["data"] for result in bucket["results"]]
    return results[0] if results and results[0]["num_model_requests"] == requests else None


def served_prompt_tokens(pool: str, model: str, messages: list[dict], tools: list[dict]) -> list[int]:
    """The prompt's token ids as the engine rendered them for a chat request with these tools."""
    body = {"model": model, "messages": messages, "tools": tools, "max_tokens": 1, "return_token_ids": True}
    response = httpx.post(f"{pool}/v1/chat/completions", json=body, headers=internal_headers(), timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["prompt_token_ids"]


def assert_trained_as_served(pool: str, model: str, weights) -> None:
    """Each prompt of a tool conversation (the question; the question, call and result) is the start of
    the trainer's tokens, and the trainer trains exactly the replies that follow them."""
    line = weather_line("Ljubljana", "What's the weather like in {city}?", answered=2)
    example, error = parse_example(json.dumps(line))
    assert error is None, error
    tokenizer = load_tokenizer(weights)
    trained = tokenize_example(tokenizer, example)
    for prompt_end in (1, 3):  # the call answers the question; the reply answers the tool's result
        prompt = served_prompt_tokens(pool, model, line["messages"][:prompt_end], line["tools"])
        assert trained.input_ids[: len(prompt)] == prompt
        assert prompt_end > 1 or not any(trained.trained[: len(prompt)])  # the question is never trained
        reply = tokenizer.decode([t for t, on in zip(trained.input_ids[len(prompt) :], trained.trained[len(prompt) :]) if on])
        expected = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ljubljana"}}\n</tool_call>'
        assert reply.startswith(expected if prompt_end == 1 else line["messages"][3]["content"])
