"""The training loop in the caller's hands, driven by the official ``tinker`` SDK unchanged against
the gateway, on the real engine and a real trainer: Tinker's own quickstart (supervised pig latin:
forward_backward, optim_step, then sample from the saved weights) lowers its loss and changes what
the pool answers; a state saved with its optimizer is where a new run goes on from; and another
organization can use none of it."""

# ruff: noqa: F811 (pytest fixtures are imported from tests.inference_fixtures, then named as arguments)
from __future__ import annotations

import httpx
import pytest
import tinker
from tinker import types

from tests.inference_fixtures import BASE, alice, charlie, gateway  # noqa: F401 (fixtures)
from tests.tinker_examples import EXAMPLES, YES_OR_NO, chat_prompt, loss_per_token, process_example, rl_step

pytestmark = [pytest.mark.engine, pytest.mark.training, pytest.mark.django_db(transaction=True)]

_opened: list[tinker.ServiceClient] = []


def service_client(gateway: str, persona) -> tinker.ServiceClient:
    client = tinker.ServiceClient(base_url=gateway, api_key=f"tml-{persona.api_key}")
    _opened.append(client)
    return client


@pytest.fixture(autouse=True)
def _sessions_closed():
    """Each test's sessions end with it, as a script's do when it exits: their runs stop, their
    heartbeats with a key the next test no longer has stop too."""
    yield
    while _opened:
        try:
            _opened.pop().close("success").result(timeout=30)
        except Exception:  # noqa: BLE001 - the persona may be gone already: its session is then gone too
            pass


# The catalog's engine serves ranks up to 16 (max_lora_rank); the SDK's default is 32, which the server
# refuses with a 400 naming the limit (docs/training-loops.md).
RANK = 16


def test_tinkers_quickstart_lowers_the_loss_and_the_saved_weights_answer_differently(gateway, inference_pool, loop_trainer, alice):
    client = service_client(gateway, alice)
    training_client = client.create_lora_training_client(base_model=BASE, rank=RANK)
    tokenizer = training_client.get_tokenizer()
    processed_examples = [process_example(ex, tokenizer) for ex in EXAMPLES]
    prompt = types.ModelInput.from_ints(tokenizer.encode("English: coffee break\nPig Latin:"))
    params = types.SamplingParams(max_tokens=20, temperature=0.0, stop=["\n"])
    before = client.create_sampling_client(base_model=BASE).sample(prompt=prompt, sampling_params=params, num_samples=1).result()

    losses = []
    for _ in range(6):
        fwdbwd_future = training_client.forward_backward(processed_examples, "cross_entropy")
        optim_future = training_client.optim_step(types.AdamParams(learning_rate=1e-4))
        fwdbwd_result = fwdbwd_future.result()
        optim_future.result()
        losses.append(loss_per_token(fwdbwd_result, processed_examples))
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.5, losses

    sampling_client = training_client.save_weights_and_get_sampling_client(name="pig-latin-model")
    result = sampling_client.sample(prompt=prompt, sampling_params=params, num_samples=8).result()
    assert len(result.sequences) == 8
    texts = {tokenizer.decode(seq.tokens) for seq in result.sequences}
    assert len(texts) == 1, texts  # greedy: eight times the same answer
    assert result.sequences[0].tokens != before.sequences[0].tokens  # the saved weights answer, not the base model
    sequence = result.sequences[0]
    assert len(sequence.logprobs) == len(sequence.tokens) and all(logprob <= 0 for logprob in sequence.logprobs)


def test_a_saved_state_is_where_a_new_run_goes_on_from_with_its_optimizer(gateway, inference_pool, loop_trainer, alice):
    client = service_client(gateway, alice)
    training_client = client.create_lora_training_client(base_model=BASE, rank=8)
    tokenizer = training_client.get_tokenizer()
    data = [process_example(ex, tokenizer) for ex in EXAMPLES[:3]]
    for _ in range(2):
        training_client.forward_backward(data, "cross_entropy").result()
        training_client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    path = training_client.save_state("after-two").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/after-two")

    resumed = client.create_training_client_from_state_with_optimizer(path)
    same = resumed.forward_backward(data, "cross_entropy").result()
    there = training_client.forward_backward(data, "cross_entropy").result()
    assert loss_per_token(same, data) == pytest.approx(loss_per_token(there, data), rel=1e-4)


def test_another_organization_can_use_no_part_of_a_run(gateway, inference_pool, loop_trainer, alice, charlie):
    training_client = service_client(gateway, alice).create_lora_training_client(base_model=BASE, rank=8)
    tokenizer = training_client.get_tokenizer()
    path = training_client.save_weights_for_sampler("shared-nothing").result().path
    outsider = service_client(gateway, charlie)
    with pytest.raises(Exception, match="404|not found|No such"):
        outsider.create_sampling_client(model_path=path).sample(
            prompt=types.ModelInput.from_ints(tokenizer.encode("Hi")), sampling_params=types.SamplingParams(max_tokens=2),
            num_samples=1,
        ).result()
    with pytest.raises(Exception, match="404|not found|No such"):
        outsider.create_training_client_from_state(path.replace("sampler_weights", "weights")).result()


def test_an_rl_loop_written_with_the_sdk_raises_its_mean_reward_and_its_weights_publish_as_a_model(
    gateway, inference_pool, loop_trainer, alice
):
    client = service_client(gateway, alice)
    training_client = client.create_lora_training_client(base_model=BASE, rank=RANK)
    tokenizer = training_client.get_tokenizer()
    prompts = [chat_prompt(tokenizer, question) for question in YES_OR_NO]
    rewards = []
    for step in range(3):
        sampling_client = training_client.save_weights_and_get_sampling_client()
        rewards.append(rl_step(training_client, sampling_client, tokenizer, prompts, seed=step))
    assert rewards[-1] > rewards[0] + 0.2, rewards

    path = training_client.save_weights_for_sampler("says-yes").result().path
    run_id = path.removeprefix("tinker://").split("/")[0]
    published = httpx.post(
        f"{gateway}/api/v1/training_runs/{run_id}/checkpoints/sampler_weights/says-yes/publish",
        headers={"X-API-Key": f"tml-{alice.api_key}"}, json={"suffix": "says-yes"}, timeout=60,
    )
    assert published.status_code == 200, published.text
    model = published.json()["model"]
    assert model == f"{BASE}:says-yes"
    answer = alice.client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Answer yes or no. Is grass green?"}], max_tokens=8, temperature=0
    )
    assert "yes" in (answer.choices[0].message.content or "").lower()
