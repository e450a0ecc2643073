"""Tinker's own examples, as its users write them with the SDK: the quickstart's pig latin
(supervised), and an RL loop (sample a group per prompt, grade, centre the rewards per group,
``importance_sampling``, ``optim_step``). Shared by the engine tests and the running-product test."""

from __future__ import annotations

import numpy as np
from tinker import types

# Tinker's quickstart examples, as written there.
EXAMPLES = [
    {"input": "banana split", "output": "anana-bay plit-say"},
    {"input": "quantum physics", "output": "uantum-qay ysics-phay"},
    {"input": "donut shop", "output": "onut-day op-shay"},
    {"input": "pickle jar", "output": "ickle-pay ar-jay"},
    {"input": "space exploration", "output": "ace-spay exploration-way"},
    {"input": "rubber duck", "output": "ubber-ray uck-day"},
    {"input": "coding wizard", "output": "oding-cay izard-way"},
]


def process_example(example: dict, tokenizer) -> types.Datum:
    """The quickstart's own function, unchanged."""
    prompt = f"English: {example['input']}\nPig Latin:"
    prompt_tokens = tokenizer.encode(prompt, add_special_tokens=True)
    prompt_weights = [0] * len(prompt_tokens)
    completion_tokens = tokenizer.encode(f" {example['output']}\n\n", add_special_tokens=False)
    completion_weights = [1] * len(completion_tokens)
    tokens = prompt_tokens + completion_tokens
    weights = prompt_weights + completion_weights
    input_tokens = tokens[:-1]
    target_tokens = tokens[1:]
    weights = weights[1:]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens=input_tokens),
        loss_fn_inputs=dict(weights=weights, target_tokens=target_tokens),
    )


def loss_per_token(result, processed: list[types.Datum]) -> float:
    logprobs = np.concatenate([output["logprobs"].tolist() for output in result.loss_fn_outputs])
    weights = np.concatenate([example.loss_fn_inputs["weights"].tolist() for example in processed])
    return float(-np.dot(logprobs, weights) / weights.sum())


YES_OR_NO = ["Is water wet?", "Is the sky blue?", "Is fire hot?", "Is snow cold?"]


def chat_prompt(tokenizer, question: str) -> types.ModelInput:
    text = tokenizer.apply_chat_template([{"role": "user", "content": f"Answer yes or no. {question}"}], add_generation_prompt=True, tokenize=False)
    return types.ModelInput.from_ints(tokenizer.encode(text, add_special_tokens=False))


def rl_step(training_client, sampling_client, tokenizer, prompts: list[types.ModelInput], seed: int) -> float:
    """One step of an RL loop as the SDK's users write it: sample a group per prompt, grade, centre the
    rewards per group, ``importance_sampling`` with the sampler's logprobs, ``optim_step``. Its mean reward."""
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=seed)
    futures = [sampling_client.sample(prompt=prompt, num_samples=8, sampling_params=params) for prompt in prompts]
    data, rewards = [], []
    for prompt, future in zip(prompts, futures):
        group = future.result().sequences
        scores = [1.0 if "yes" in tokenizer.decode(sequence.tokens).lower() else 0.0 for sequence in group]
        rewards += scores
        for sequence, score in zip(group, scores):
            advantage = score - float(np.mean(scores))
            tokens, before = prompt.to_ints() + sequence.tokens, prompt.length - 1
            data.append(types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": [0.0] * before + list(sequence.logprobs),
                                "advantages": [0.0] * before + [advantage] * len(sequence.tokens)},
            ))
    training_client.forward_backward(data, "importance_sampling").result()
    training_client.optim_step(types.AdamParams(learning_rate=3e-4)).result()
    return float(np.mean(rewards))


