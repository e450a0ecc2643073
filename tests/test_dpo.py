"""Preference fine-tuning (DPO): preference files checked line by line, DPO jobs created as OpenAI's API
creates them, the loss as the paper defines it, and a real run on the base model that learns a style.

The run is small (16 pairs, four steps) so the file stays under a minute on two shared CPU cores.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.datasets import PREFERENCE, LineError, PreferencePair, parse_dataset
from finetuning import results
from finetuning.files import check_dataset
from finetuning.models import FineTuningJob, record_event
from tests.environment import ROOT
from tests.file_uploads import error_of, upload
from tests.personas import jsonl, preference_dataset, preference_example
from workers.training import StepMetrics, TrainingConfig, train
from workers.training.attention import PACKED_SDPA
from workers.training.model import load_model_with_lora, reference_model, save_adapter
from workers.training.preference import pack_pairs, reference_log_probs, sequence_log_probs, tokenize_pair
from workers.training.preference_loss import PreferenceTally, dpo_scores

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
BASE_MODEL_PATH = ROOT / "data" / "models" / BASE


# The dataset check.


def test_a_preference_file_is_checked_and_counted_as_the_trainer_feeds_it():
    dataset, counts = check_dataset(preference_dataset(12))
    assert dataset.ok and dataset.format == PREFERENCE and dataset.example_count == 12
    pair = dataset.examples[0]
    assert isinstance(pair, PreferencePair)
    assert pair.chosen[-1] == {"role": "assistant", "content": "ARR! 0, matey.", "weight": 1}
    assert pair.rejected[-1]["content"] == "0."
    assert len(counts) == 24  # each pair's two conversations, the input with each answer


def test_earlier_replies_in_a_preference_input_are_context_not_trained():
    line = preference_example("Go on.", "ARR!", "Fine.")
    line["input"]["messages"] = [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Go on."},
    ]
    pair = parse_dataset(jsonl([line] * 10), min_examples=1).examples[0]
    assert [m.get("weight") for m in pair.chosen] == [1, 0, 1, 1]


GOOD = preference_example("Hi", "ARR!", "Hello.")


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({**GOOD, "preferred_output": [{"role": "user", "content": "x"}]}, "preferred_output[0].role must be assistant"),
        ({**GOOD, "preferred_output": {"role": "assistant", "content": "x"}}, "preferred_output must be a list of one message"),
        ({**GOOD, "non_preferred_output": [{"role": "assistant", "content": "a"}] * 2}, "non_preferred_output must be a list of one message"),
        ({**GOOD, "non_preferred_output": [{"role": "assistant", "content": 3}]}, "non_preferred_output[0].content must be a string"),
        ({**GOOD, "non_preferred_output": [{"role": "assistant", "content": "a", "weight": 0}]}, "weight is not allowed"),
        ({**GOOD, "preferred_output": [{"role": "assistant", "content": "a\u0000"}]}, "preferred_output[0].content contains a NUL"),
        ({"input": GOOD["input"], "preferred_output": GOOD["preferred_output"]}, "non_preferred_output missing"),
        ({**GOOD, "input": {"messages": []}}, "input.messages must be a non-empty list"),
        ({**GOOD, "input": [{"role": "user", "content": "x"}]}, 'input must be an object with "messages"'),
        ({**GOOD, "input": {"messages": [{"role": "assistant", "content": "x"}]}}, "input.messages[0] is from the assistant"),
        ({**GOOD, "input": {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}},
         "input.messages ends with an assistant message"),
        ({**GOOD, "input": {"messages": GOOD["input"]["messages"], "tools": "all"}}, "input.tools must be a list of objects"),
        ({**GOOD, "messages": [{"role": "user", "content": "x"}]}, "not several"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}, "a chat line"),
    ],
)
def test_a_bad_preference_line_is_named_by_its_number(bad, message):
    data = jsonl([GOOD] * 3 + [bad] + [GOOD] * 8)
    dataset = parse_dataset(data, min_examples=10)
    assert [error.line for error in dataset.errors] == [4], dataset.errors
    assert message in dataset.errors[0].message


def test_a_file_holds_one_format_named_by_its_first_example():
    chat = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
    dataset = parse_dataset(jsonl([chat] * 10 + [GOOD]), min_examples=10)
    assert dataset.errors == [LineError(11, dataset.errors[0].message)]
    assert dataset.errors[0].message.startswith("a preference line ({\"input\", \"preferred_output\", \"non_preferred_output\"}) in a file of chat lines")


def test_a_pair_too_long_for_the_context_names_the_answer(settings):
    long_answer = preference_example("Hi", "ARR! " * 3000, "Hello.")
    dataset, _ = check_dataset(jsonl([GOOD] * 10 + [long_answer]))
    assert dataset.errors[0].line == 11
    assert "(the input with preferred_output), longer than the model's context" in dataset.errors[0].message


# The API.


@pytest.fixture
def pairs_file(alice) -> str:
    return upload(alice, preference_dataset(12)).json()["id"]


@pytest.fixture
def chat_file(alice) -> str:
    from tests.personas import good_dataset

    return upload(alice, good_dataset(12)).json()["id"]


def create(persona, **body):
    return persona.api.post("/v1/fine_tuning/jobs", body, format="json")


@pytest.mark.django_db
def test_a_dpo_job_resolves_beta_and_echoes_its_method(alice, pairs_file):
    method = {"type": "dpo", "dpo": {"hyperparameters": {"n_epochs": 2}}}
    response = create(alice, model=BASE, training_file=pairs_file, method=method)
    job = response.json()
    assert response.status_code == 200, job
    hyperparameters = job["method"]["dpo"]["hyperparameters"]
    assert job["method"]["type"] == "dpo" and hyperparameters["beta"] == 0.1 and hyperparameters["n_epochs"] == 2
    assert isinstance(hyperparameters["batch_size"], int) and hyperparameters["learning_rate_multiplier"] == 1.0
    assert FineTuningJob.objects.get(pk=job["id"]).method == "dpo"
    assert "12 preference pairs" in alice.api.get(f"/v1/fine_tuning/jobs/{job['id']}/events").json()["data"][-1]["message"]


@pytest.mark.django_db
def test_a_dpo_job_takes_its_beta_and_the_platforms_hyperparameters(alice, pairs_file):
    hyperparameters = {"beta": 0.5, "batch_size": 4, "learning_rate_multiplier": 2, "lora_r": 4, "n_evals": 2}
    job = create(alice, model=BASE, training_file=pairs_file, validation_file=pairs_file,
                 method={"type": "dpo", "dpo": {"hyperparameters": hyperparameters}}).json()
    resolved = job["method"]["dpo"]["hyperparameters"]
    assert {key: resolved[key] for key in hyperparameters} == hyperparameters | {"learning_rate_multiplier": 2.0}


@pytest.mark.django_db
def test_the_supervised_method_is_todays_job_and_records_no_beta(alice, chat_file):
    job = create(alice, model=BASE, training_file=chat_file, method={"type": "supervised"}).json()
    assert job["method"]["type"] == "supervised" and "beta" not in job["method"]["supervised"]["hyperparameters"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("method", "file", "param", "message"),
    [
        ({"type": "supervised"}, "pairs", "training_file", "holds preference lines"),
        ({"type": "dpo"}, "chat", "training_file", "the dpo method trains on preference lines"),
        ({"type": "reinforcement"}, "pairs", "method.reinforcement", 'give {"grader": {...}}'),
        ({"type": "dpo", "dpo": {"hyperparameters": {"beta": 0}}}, "pairs", "method.dpo.hyperparameters.beta", '"auto" or a number from 0.001 to 10'),
        ({"type": "dpo", "dpo": {"hyperparameters": {"beta": "high"}}}, "pairs", "method.dpo.hyperparameters.beta", '"auto" or a number'),
        ({"type": "dpo", "dpo": {"hyperparameters": {"beta": True}}}, "pairs", "method.dpo.hyperparameters.beta", '"auto" or a number'),
        ({"type": "dpo", "dpo": {"hyperparameters": {"gamma": 1}}}, "pairs", "method.dpo.hyperparameters", "unknown parameter(s) gamma"),
        ({"type": "dpo", "dpo": {"hyperparameters": {"n_epochs": 0}}}, "pairs", "method.dpo.hyperparameters.n_epochs", "from 1 to 50"),
        ({"type": "dpo", "supervised": {"hyperparameters": {}}}, "pairs", "method.supervised", "type is 'dpo'"),
        ({"type": "supervised", "supervised": {"hyperparameters": {"beta": 0.1}}}, "chat", "method.supervised.hyperparameters", "unknown parameter(s) beta"),
        ({"type": "dpo", "extra": 1}, "pairs", "method", "unknown parameter(s) extra"),
        ("dpo", "pairs", "method", "Expected a dictionary"),
    ],
)
def test_a_bad_method_is_refused_with_its_field_and_nothing_is_queued(alice, pairs_file, chat_file, method, file, param, message):
    training_file = pairs_file if file == "pairs" else chat_file
    response = create(alice, model=BASE, training_file=training_file, method=method)
    assert response.status_code == 400, response.json()
    error = error_of(response)
    assert error["param"] == param and message in error["message"], error
    assert FineTuningJob.objects.count() == 0


@pytest.mark.django_db
def test_a_dpo_jobs_validation_file_must_hold_pairs_too(alice, pairs_file, chat_file):
    response = create(alice, model=BASE, training_file=pairs_file, validation_file=chat_file, method={"type": "dpo"})
    assert response.status_code == 400 and error_of(response)["param"] == "validation_file"
    assert "holds chat lines" in error_of(response)["message"]


@pytest.mark.django_db
def test_a_dpo_jobs_result_file_has_the_preference_columns(alice, pairs_file):
    job = FineTuningJob.objects.get(pk=create(alice, model=BASE, training_file=pairs_file, method={"type": "dpo"}).json()["id"])
    record_event(job, "Step 1/1", data={"step": 1, "epoch": 1, "train_loss": 0.69, "valid_loss": None, "trained_tokens": 40,
                                        "tokens_per_second": 9.0, "reward_margin": 0.0, "preference_accuracy": 0.0})
    rows = list(csv.reader(io.StringIO(results.metrics_csv(job).decode())))
    assert rows == [list(results.PREFERENCE_COLUMNS), ["1", "1", "0.69", "", "40", "9.0", "0.0", "0.0"]]
    assert results.PREFERENCE_COLUMNS[:6] == results.COLUMNS


# The loss.


def test_the_dpo_loss_equals_the_papers_formula_computed_by_hand():
    # Two pairs: log-probabilities of the chosen and rejected answers under the policy and the reference.
    policy_chosen, policy_rejected = torch.tensor([-10.0, -7.0], requires_grad=True), torch.tensor([-12.0, -5.0])
    reference_chosen, reference_rejected = torch.tensor([-11.0, -6.0]), torch.tensor([-11.5, -6.5])
    scores = dpo_scores(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta=0.5)
    # Pair 1: 0.5 * ((-10 + 11) - (-12 + 11.5)) = 0.5 * (1 + 0.5) = 0.75; pair 2: 0.5 * ((-1) - (1.5)) = -1.25.
    assert scores.margins.tolist() == [0.75, -1.25]
    expected = [math.log(1 + math.exp(-0.75)), math.log(1 + math.exp(1.25))]  # -log(sigmoid(m))
    assert scores.losses.tolist() == pytest.approx(expected, abs=1e-6)
    scores.losses.mean().backward()  # the gradient reaches the policy: -beta * sigmoid(-m) / n per chosen answer
    assert policy_chosen.grad.tolist() == pytest.approx([-0.5 * torch.sigmoid(torch.tensor(-m)).item() / 2 for m in (0.75, -1.25)])
    tally = PreferenceTally()
    tally.add(scores)
    assert (tally.mean_loss(), tally.reward_margin(), tally.accuracy()) == (pytest.approx(sum(expected) / 2), -0.25, 0.5)


def test_a_huge_negative_margin_gives_a_finite_loss():
    zero = torch.zeros(1)
    scores = dpo_scores(torch.tensor([-1e4]), zero, zero, zero, beta=1.0)
    assert scores.losses.item() == pytest.approx(1e4)


# Training on the base model.


PAIRS = [
    ("What is two plus two?", "Two plus two is four."), ("Name a primary colour.", "Red is a primary colour."),
    ("How many legs does a spider have?", "A spider has eight legs."), ("What is the opposite of hot?", "The opposite of hot is cold."),
    ("Which planet is closest to the sun?", "Mercury is closest to the sun."), ("What do bees make?", "Bees make honey."),
    ("What is frozen water called?", "Frozen water is called ice."), ("How many days are in a week?", "A week has seven days."),
    ("What colour is grass?", "Grass is green."), ("Which animal barks?", "A dog barks."),
    ("What is the plural of mouse?", "The plural of mouse is mice."), ("What comes after Monday?", "Tuesday comes after Monday."),
    ("How many minutes are in an hour?", "An hour has sixty minutes."), ("What do you call a baby dog?", "A baby dog is a puppy."),
    ("Is the sea salty?", "Yes, the sea is salty."), ("What shape is a ball?", "A ball is round."),
]
HELD_OUT = [
    "What is the capital of France?", "What colour is the sky?", "How many legs does a cat have?",
    "What do birds use to fly?", "What is three plus three?",
]
STYLE = "Arr!"  # every preferred answer opens with it; the non-preferred one is the same answer, plain


def pirate_pair(question: str, answer: str) -> PreferencePair:
    prompt = [{"role": "user", "content": question, "weight": 1}]
    return PreferencePair(prompt, {"role": "assistant", "content": f"{STYLE} {answer}", "weight": 1},
                          {"role": "assistant", "content": answer, "weight": 1})


class Recorder:
    def __init__(self) -> None:
        self.steps: list[StepMetrics] = []
        self.checkpoints: list[tuple[int, Path]] = []

    def on_step(self, metrics: StepMetrics) -> None:
        self.steps.append(metrics)

    def on_checkpoint(self, epoch: int, step: int, adapter_dir: Path, metrics: StepMetrics) -> None:
        self.checkpoints.append((step, adapter_dir))

    def should_stop(self) -> bool:
        return False


def dpo_config(**overrides) -> TrainingConfig:
    return TrainingConfig(base_model_path=BASE_MODEL_PATH, base_model_id=BASE, method="dpo", **overrides)


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # steady on a shared machine (tests/test_training.py says why)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(BASE_MODEL_PATH)


def greedy_answer(model, tokenizer, question: str) -> str:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    return tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.training
def test_dpo_learns_the_preferred_style_the_base_model_lacks(one_thread, tokenizer, tmp_path):
    recorder = Recorder()
    pairs = [pirate_pair(question, answer) for question, answer in PAIRS]
    result = train(dpo_config(n_epochs=1, batch_size=4, learning_rate=3e-3, seed=0), pairs, None, tmp_path, recorder)

    losses = [m.train_loss for m in recorder.steps]
    accuracies = [m.preference_accuracy for m in recorder.steps]
    print(f"\nDPO steps: loss {[round(x, 3) for x in losses]}, preference accuracy {accuracies}, "
          f"reward margin {[round(m.reward_margin, 3) for m in recorder.steps]}")
    assert losses[0] == pytest.approx(math.log(2), abs=1e-4)  # the adapter starts as a no-op: policy = reference
    assert losses[-1] < losses[0] / 2 and accuracies[-1] > accuracies[0]
    assert recorder.steps[-1].reward_margin > 0
    assert result.trained_tokens == recorder.steps[-1].trained_tokens > 0
    assert [step for step, _ in recorder.checkpoints] == [4]  # an epoch's checkpoint, as for supervised runs
    assert not (result.adapter_dir / "reference").exists()

    base = AutoModelForCausalLM.from_pretrained(BASE_MODEL_PATH, dtype=torch.float32).eval()
    base_answers = [greedy_answer(base, tokenizer, question) for question in HELD_OUT]
    tuned = PeftModel.from_pretrained(base, result.adapter_dir)
    tuned_answers = [greedy_answer(tuned, tokenizer, question) for question in HELD_OUT]
    styled = sum(answer.startswith("Arr") for answer in tuned_answers)
    base_styled = sum(answer.startswith("Arr") for answer in base_answers)
    print(f"held-out answers in the preferred style: base model {base_styled}/5, after DPO {styled}/5")
    print(json.dumps({"base": base_answers, "dpo": tuned_answers}, indent=1))
    assert styled > base_styled


@pytest.mark.training
def test_a_continued_dpo_run_is_measured_against_its_parent_adapter(one_thread, tokenizer, tmp_path):
    """The reference of a continued fine-tune is its parent adapter, loaded beside the trained one: at the
    start both give the same log-probabilities (a margin of 0), unlike the base model."""
    torch.manual_seed(0)
    parent = load_model_with_lora(dpo_config())
    with torch.no_grad():  # a parent that is not a no-op: B is zero in a fresh adapter
        for name, parameter in parent.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.02)
    parent_dir = save_adapter(parent, tmp_path / "parent")
    model = load_model_with_lora(dpo_config(init_adapter=parent_dir, reference_adapter=parent_dir))
    row = pack_pairs([tokenize_pair(tokenizer, pirate_pair(*PAIRS[0]), 2048)], 2048)[0]
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        policy = sequence_log_probs(model.eval(), row)
        with reference_model(model):
            pass  # entering and leaving the reference gives the trained adapter back, trainable
        with model.disable_adapter():
            base = sequence_log_probs(model, row)
    reference = reference_log_probs(model, row)
    assert torch.allclose(policy, reference, atol=1e-5) and not torch.allclose(policy, base, atol=1e-3)
    assert {name for name, p in model.named_parameters() if p.requires_grad} == trainable
    assert all(".default." in name for name in trainable)
    saved = save_adapter(model, tmp_path / "child")
    assert sorted(p.name for p in saved.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


def test_a_pairs_answers_are_packed_into_one_row_and_only_their_tokens_scored(tokenizer):
    pairs = [tokenize_pair(tokenizer, pirate_pair(q, a), 2048) for q, a in PAIRS[:3]]
    rows = pack_pairs(pairs, max_row_tokens=2 * max(p.n_tokens for p in pairs))
    assert sum(len(row.boundaries) - 1 for row in rows) == 6
    for row in rows:
        assert (len(row.boundaries) - 1) % 2 == 0  # whole pairs only
    chosen = pairs[0].chosen
    trained = [t for t, is_trained in zip(chosen.input_ids, chosen.trained) if is_trained]
    assert tokenizer.decode(trained) == f"{STYLE} {PAIRS[0][1]}<|im_end|>"


@pytest.mark.training
def test_a_pair_is_scored_as_the_sum_of_its_answer_tokens_log_probabilities(one_thread, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(BASE_MODEL_PATH, dtype=torch.float32, attn_implementation=PACKED_SDPA).eval()
    pair = tokenize_pair(tokenizer, pirate_pair(*PAIRS[1]), 2048)
    row = pack_pairs([pair], 2048)[0]
    with torch.no_grad():
        packed = sequence_log_probs(model, row)
        for index, example in enumerate((pair.chosen, pair.rejected)):
            logits = model(input_ids=torch.tensor([example.input_ids])).logits[0]
            log_probs = F.log_softmax(logits[:-1].float(), dim=-1)
            targets = torch.tensor(example.input_ids[1:])
            mask = torch.tensor(example.trained[1:])
            by_hand = log_probs[torch.arange(len(targets)), targets][mask].sum()
            assert packed[index].item() == pytest.approx(by_hand.item(), abs=1e-3)
