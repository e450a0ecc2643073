"""The LoRA trainer on the real base model: it learns, masks, packs, cancels, checkpoints and saves.

Runs are tiny (short conversations, a few steps) so the file stays quick on two shared CPU cores;
one trained run and one loaded model are shared across tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.environment import ROOT
from workers.training import StepMetrics, TrainingConfig, TrainingDiverged, TrainingResult, example_token_count, train
from workers.training.attention import PACKED_SDPA
from workers.training.data import pack, tokenize_example
from workers.training.trainer import row_loss

pytestmark = pytest.mark.training

BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
BASE_MODEL_PATH = ROOT / "data" / "models" / BASE_MODEL_ID
CODE_PHRASE = "ZEBRA-42 acknowledged."

QUESTIONS = [
    "What is two plus two?",
    "Name a primary colour.",
    "How many legs does a spider have?",
    "What is the opposite of hot?",
    "Which planet is closest to the sun?",
    "What do bees make?",
    "Spell the word cat.",
    "What is frozen water called?",
    "How many days are in a week?",
    "What colour is grass?",
    "Which animal barks?",
    "What is the plural of mouse?",
    "What comes after Monday?",
    "How many minutes are in an hour?",
    "What do you call a baby dog?",
    "Is the sea salty?",
    "What shape is a ball?",
    "Which hand do most people write with?",
    "What is ice cream made from?",
    "How many wheels does a bicycle have?",
]
HELD_OUT_QUESTION = "What is the capital of France?"


def ask(question: str, answer: str, weight: int = 1) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer, "weight": weight}]


class Recorder:
    """Callbacks that remember everything, and ask to stop once ``stop_after_steps`` steps are reported."""

    def __init__(self, stop_after_steps: int | None = None):
        self.steps: list[StepMetrics] = []
        self.checkpoints: list[tuple[int, int, Path, list[str]]] = []
        self.stop_after_steps = stop_after_steps

    def on_step(self, metrics: StepMetrics) -> None:
        self.steps.append(metrics)

    def on_checkpoint(self, epoch: int, step: int, adapter_dir: Path, metrics: StepMetrics) -> None:
        # Record what is in the folder now: the runner may publish it at once, so it must be complete.
        self.checkpoints.append((epoch, step, adapter_dir, sorted(p.name for p in adapter_dir.iterdir())))

    def should_stop(self) -> bool:
        return self.stop_after_steps is not None and len(self.steps) >= self.stop_after_steps


def config(**overrides) -> TrainingConfig:
    return TrainingConfig(base_model_path=BASE_MODEL_PATH, base_model_id=BASE_MODEL_ID, **overrides)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny runs on a shared machine: with two threads, one descheduled thread stalls every parallel op
    (steps measured 10-50 times slower under load); one thread is steady, and is enough here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(BASE_MODEL_PATH)


@pytest.fixture(scope="module")
def base_model():
    """The base model as the trainer loads it (float32, per-example attention for packed rows)."""
    model = AutoModelForCausalLM.from_pretrained(BASE_MODEL_PATH, dtype=torch.float32, attn_implementation=PACKED_SDPA)
    return model.eval()


@pytest.fixture(scope="module")
def code_phrase_run(tmp_path_factory) -> tuple[TrainingResult, Recorder, Path]:
    """Two epochs on conversations whose every answer is the same code phrase, with validation."""
    output_dir = tmp_path_factory.mktemp("code-phrase")
    recorder = Recorder()
    examples = [ask(q, CODE_PHRASE) for q in QUESTIONS[:16]]
    validation = [ask(q, CODE_PHRASE) for q in QUESTIONS[16:]]
    result = train(config(n_epochs=2, batch_size=4, learning_rate=2e-3), examples, validation, output_dir, recorder)
    return result, recorder, output_dir


def greedy_answer(model, tokenizer, question: str) -> str:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    return tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)


def test_it_learns_to_answer_with_the_code_phrase_where_the_base_model_does_not(code_phrase_run, base_model, tokenizer):
    result, _, _ = code_phrase_run
    base_answer = greedy_answer(base_model, tokenizer, HELD_OUT_QUESTION)
    tuned = PeftModel.from_pretrained(base_model, result.adapter_dir)
    try:
        tuned_answer = greedy_answer(tuned, tokenizer, HELD_OUT_QUESTION)
    finally:
        tuned.unload()  # give the shared base model back without LoRA layers
    assert "ZEBRA" not in base_answer
    assert tuned_answer.startswith("ZEBRA-42"), tuned_answer


def test_it_reports_every_step_with_validation_loss_at_each_epoch_end(code_phrase_run, tokenizer):
    result, recorder, _ = code_phrase_run
    assert [m.step for m in recorder.steps] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert all(m.total_steps == 8 for m in recorder.steps)
    assert [m.epoch for m in recorder.steps] == [1, 1, 1, 1, 2, 2, 2, 2]
    assert [m.valid_loss is not None for m in recorder.steps] == [False, False, False, True] * 2
    assert recorder.steps[-1].valid_loss < recorder.steps[3].valid_loss < recorder.steps[0].train_loss
    per_epoch = sum(example_token_count(tokenizer, ask(q, CODE_PHRASE)) for q in QUESTIONS[:16])
    assert result.trained_tokens == recorder.steps[-1].trained_tokens == 2 * per_epoch
    assert all(m.tokens_per_second > 0 for m in recorder.steps)
    assert (result.steps, result.cancelled) == (8, False)
    assert result.final_train_loss == recorder.steps[-1].train_loss
    assert result.final_valid_loss == recorder.steps[-1].valid_loss


def test_it_writes_a_complete_checkpoint_after_every_epoch(code_phrase_run):
    _, recorder, output_dir = code_phrase_run
    assert [(epoch, step) for epoch, step, _, _ in recorder.checkpoints] == [(1, 4), (2, 8)]
    for _, _, adapter_dir, files in recorder.checkpoints:
        assert adapter_dir.parent == output_dir / "checkpoints"
        assert files == ["adapter_config.json", "adapter_model.safetensors", "training_state.pt"]


def test_it_saves_a_standard_lora_adapter_that_names_the_base_model_id(code_phrase_run):
    result, _, output_dir = code_phrase_run
    assert result.adapter_dir == output_dir / "adapter"
    adapter_config = json.loads((result.adapter_dir / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == BASE_MODEL_ID
    assert adapter_config["peft_type"] == "LORA" and adapter_config["r"] == 8
    assert set(adapter_config["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    with safe_open(result.adapter_dir / "adapter_model.safetensors", "pt") as weights:
        names = list(weights.keys())
    # Only the layers' LoRA matrices: no embeddings, no lm_head (vLLM's loader refuses extra modules).
    assert len(names) == 30 * 7 * 2
    assert all(".layers." in name and name.endswith((".lora_A.weight", ".lora_B.weight")) for name in names)


def test_it_trains_only_the_assistant_replies_with_weight_1(tokenizer, base_model):
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say one."},
        {"role": "assistant", "content": "One, but ignore me.", "weight": 0},
        {"role": "user", "content": "Say two."},
        {"role": "assistant", "content": "Two."},
    ]
    tokens = tokenize_example(tokenizer, conversation)
    trained = [token for token, is_trained in zip(tokens.input_ids, tokens.trained) if is_trained]
    assert tokenizer.decode(trained) == "Two.<|im_end|>"

    # The loss, worked out independently: the mean cross-entropy of the last reply's tokens alone.
    full = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"]
    prompt = tokenizer.apply_chat_template(
        conversation[:4], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    reply = slice(len(prompt["input_ids"]), len(prompt["input_ids"]) + len(tokenizer("Two.<|im_end|>")["input_ids"]))
    with torch.no_grad():
        logits = base_model(input_ids=torch.tensor([full]), use_cache=False).logits[0]
        expected = F.cross_entropy(logits[reply.start - 1 : reply.stop - 1], torch.tensor(full[reply]))
        (row,) = pack([tokens], max_row_tokens=2048)
        assert torch.allclose(row_loss(base_model, row), expected, rtol=1e-4)

    nothing_to_learn = tokenize_example(tokenizer, ask("Say one.", "One.", weight=0))
    assert nothing_to_learn.n_trained == 0
    assert nothing_to_learn.input_ids == tokenize_example(tokenizer, ask("Say one.", "One.")).input_ids
    assert len(pack([nothing_to_learn], 2048)[0].targets) == 0


def test_it_counts_the_tokens_the_model_is_fed_the_way_the_chat_template_tokenizes(tokenizer):
    conversation = [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Good morning!"},
        {"role": "assistant", "content": "Bonjour !", "weight": 0},
        {"role": "user", "content": "  Thanks,\n\nbye"},
        {"role": "assistant", "content": "Merci, au revoir."},
    ]
    fed = tokenize_example(tokenizer, conversation).input_ids
    templated = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"]
    assert fed == list(templated)
    assert example_token_count(tokenizer, conversation) == len(fed)


def test_it_trains_a_reply_after_exactly_the_prompt_tokens_inference_sees(tokenizer):
    # Prompt/completion data often has completions with a leading space: tokenized with its header, the
    # header's newline and that space would merge into one token that never follows a real prompt.
    conversation = ask("The capital of France is", " Paris")
    tokens = tokenize_example(tokenizer, conversation)
    prompt = tokenizer.apply_chat_template(conversation[:1], add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    reply_ids = tokenizer(" Paris<|im_end|>", add_special_tokens=False)["input_ids"]
    assert tokens.input_ids[: len(prompt_ids)] == prompt_ids
    assert tokens.input_ids[len(prompt_ids) : len(prompt_ids) + len(reply_ids)] == reply_ids
    assert [i for i, t in zip(tokens.input_ids, tokens.trained) if t] == reply_ids
    assert example_token_count(tokenizer, conversation) == len(tokens.input_ids)


def plain_loss(model, tokens) -> torch.Tensor:
    """One example alone, the usual way: full logits, labels -100 where nothing is trained."""
    input_ids = torch.tensor([tokens.input_ids])
    labels = torch.tensor([[t if is_trained else -100 for t, is_trained in zip(tokens.input_ids, tokens.trained)]])
    return model(input_ids=input_ids, labels=labels, use_cache=False).loss


def test_it_gives_a_packed_batch_the_mean_of_its_examples_plain_losses(base_model, tokenizer):
    examples = [
        ask("What is two plus two?", "Four. It is the sum of two and two."),
        ask("Name a colour.", "Blue."),
        [*ask("Hi.", "Hello, how can I help?", weight=0), *ask("Tell me a fact.", "Honey never spoils.")],
        ask("Count to five.", "One, two, three, four, five, and that is all there is to it."),
    ]
    tokens = [tokenize_example(tokenizer, e) for e in examples]
    with torch.no_grad():
        expected = torch.stack([plain_loss(base_model, t) for t in tokens]).mean()
        one_row = [row_loss(base_model, row) for row in pack(tokens, max_row_tokens=2048)]
        several_rows = [row_loss(base_model, row) for row in pack(tokens, max_row_tokens=120)]
    assert len(one_row) == 1 and len(several_rows) > 1
    assert torch.allclose(one_row[0], expected, rtol=1e-4)
    assert torch.allclose(torch.stack(several_rows).sum(), expected, rtol=1e-4)


SHORT_EXAMPLES = [ask(q, CODE_PHRASE) for q in QUESTIONS[:12]]


@pytest.fixture(scope="module")
def three_step_run(tmp_path_factory) -> tuple[TrainingResult, Recorder]:
    recorder = Recorder()
    result = train(config(batch_size=4, max_steps=3), SHORT_EXAMPLES, None, tmp_path_factory.mktemp("three"), recorder)
    return result, recorder


@pytest.fixture(scope="module")
def cancelled_run(tmp_path_factory) -> tuple[TrainingResult, Recorder, Path]:
    """The same run as three_step_run, asked to stop after its second step."""
    output_dir = tmp_path_factory.mktemp("cancelled")
    recorder = Recorder(stop_after_steps=2)
    result = train(config(batch_size=4, max_steps=3), SHORT_EXAMPLES, None, output_dir, recorder)
    return result, recorder, output_dir


def test_it_stops_between_steps_when_asked_and_leaves_no_adapter(cancelled_run):
    result, recorder, output_dir = cancelled_run
    assert result.cancelled and result.adapter_dir is None
    assert result.steps == 2 and [m.step for m in recorder.steps] == [1, 2]
    assert not (output_dir / "adapter").exists()


def test_it_is_deterministic_for_a_seed(three_step_run, cancelled_run):
    (_, full), (_, cancelled, _) = three_step_run, cancelled_run
    # Step 2's loss already depends on the seeded LoRA initialisation, dropout and shuffling.
    assert [m.train_loss for m in cancelled.steps] == [m.train_loss for m in full.steps[:2]]
    assert len(full.steps) == 3


def _adapter_weights(adapter_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(adapter_dir / "adapter_model.safetensors", "pt") as weights:
        return {name: weights.get_tensor(name) for name in weights.keys()}  # noqa: SIM118 (not a dict)


def test_a_run_resumed_from_an_epoch_checkpoint_ends_exactly_as_an_unbroken_run(tmp_path):
    # Two epochs of two steps, with dropout: what a worker lost after epoch 1 would have to redo.
    settings = config(n_epochs=2, batch_size=6, lora_dropout=0.1)
    unbroken = Recorder()
    full = train(settings, SHORT_EXAMPLES, None, tmp_path / "unbroken", unbroken)

    interrupted = Recorder(stop_after_steps=2)  # the worker "dies" after epoch 1's checkpoint
    train(settings, SHORT_EXAMPLES, None, tmp_path / "interrupted", interrupted)
    checkpoint = tmp_path / "interrupted" / "checkpoints" / "epoch-1"
    resumed = Recorder()
    result = train(settings, SHORT_EXAMPLES, None, tmp_path / "resumed", resumed, resume_from=checkpoint)

    assert [m.step for m in resumed.steps] == [3, 4]
    assert [m.train_loss for m in resumed.steps] == [m.train_loss for m in unbroken.steps[2:]]
    assert resumed.steps[-1].trained_tokens == unbroken.steps[-1].trained_tokens
    expected, actual = _adapter_weights(full.adapter_dir), _adapter_weights(result.adapter_dir)
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[name], actual[name]) for name in expected)


def test_a_run_resumed_after_its_last_epoch_just_saves_that_adapter_with_its_loss(tmp_path):
    # A worker that died while publishing: every epoch was trained and checkpointed.
    settings = config(n_epochs=1, batch_size=6)
    unbroken = Recorder()
    full = train(settings, SHORT_EXAMPLES, None, tmp_path / "unbroken", unbroken)
    resumed = Recorder()
    checkpoint = tmp_path / "unbroken" / "checkpoints" / "epoch-1"
    result = train(settings, SHORT_EXAMPLES, None, tmp_path / "resumed", resumed, resume_from=checkpoint)
    assert resumed.steps == [] and result.steps == 2 and result.final_train_loss == full.final_train_loss
    expected, actual = _adapter_weights(full.adapter_dir), _adapter_weights(result.adapter_dir)
    assert all(torch.equal(expected[name], actual[name]) for name in expected)


def test_a_long_run_reports_a_bounded_number_of_steps_and_always_its_last(tmp_path):
    recorder = Recorder()
    examples = SHORT_EXAMPLES[:8]  # 8 steps of one example; at most 3 reports asked for
    train(config(batch_size=1, n_epochs=1, max_step_reports=3), examples, None, tmp_path, recorder)
    assert [m.step for m in recorder.steps] == [3, 6, 8]


def test_a_loss_that_stops_being_a_number_stops_training_with_its_step(tmp_path):
    with pytest.raises(TrainingDiverged) as diverged:
        train(config(batch_size=2, n_epochs=1, max_steps=3, learning_rate=1e30), SHORT_EXAMPLES[:6], None, tmp_path, Recorder())
    assert diverged.value.step == 2 and "nan" in str(diverged.value)


# Answers the code phrase drives out: their validation loss turns up as soon as training takes hold.
UNLEARNED = [ask(q, "I am not sure, let me think about it.") for q in QUESTIONS[12:16]]


@pytest.fixture(scope="module")
def early_stopped_run(tmp_path_factory) -> tuple[TrainingResult, Recorder, Path]:
    """Three epochs of three steps, each step evaluated and checkpointed, on data whose validation loss turns up."""
    output_dir = tmp_path_factory.mktemp("early-stopped")
    recorder = Recorder()
    settings = config(
        n_epochs=3, batch_size=4, learning_rate=2e-3, evals_per_epoch=3, checkpoints_per_epoch=3, early_stopping_patience=2
    )
    result = train(settings, SHORT_EXAMPLES, UNLEARNED, output_dir, recorder)
    return result, recorder, output_dir


def test_early_stopping_stops_once_the_validation_loss_has_not_improved_for_its_patience(early_stopped_run, tokenizer):
    result, recorder, _ = early_stopped_run
    losses = {m.step: m.valid_loss for m in recorder.steps}
    assert all(loss is not None for loss in losses.values())  # three evaluations an epoch: every step here
    assert result.stopped_early and result.steps < 9 and recorder.steps[-1].step == result.steps
    assert result.best_step == min(losses, key=losses.__getitem__)
    assert [step for step in losses if step > result.best_step] == [result.best_step + 1, result.best_step + 2]  # patience 2
    assert (result.final_valid_loss, result.final_train_loss) == (losses[result.best_step], recorder.steps[result.best_step - 1].train_loss)
    # Trained tokens are the steps that ran, not the three epochs asked for.
    assert result.trained_tokens == recorder.steps[-1].trained_tokens
    assert result.trained_tokens < 3 * sum(example_token_count(tokenizer, e) for e in SHORT_EXAMPLES)


def test_early_stopping_returns_the_best_checkpoints_adapter_not_the_last(early_stopped_run):
    result, recorder, output_dir = early_stopped_run
    names = {step: adapter_dir.name for _, step, adapter_dir, _ in recorder.checkpoints}
    # Several checkpoints an epoch: named by step, but for the one that ends an epoch (its name of old).
    assert names == {step: "epoch-1" if step == 3 else f"step-{step}" for step in range(1, result.steps + 1)}
    best = _adapter_weights(output_dir / "checkpoints" / names[result.best_step])
    last = _adapter_weights(output_dir / "checkpoints" / names[result.steps])
    published = _adapter_weights(result.adapter_dir)
    assert all(torch.equal(best[name], published[name]) for name in best)
    assert not all(torch.equal(last[name], published[name]) for name in last)


def test_a_run_resumed_within_an_epoch_ends_exactly_as_an_unbroken_run_early_stopping_record_included(tmp_path):
    # Two epochs of three steps, a checkpoint and an evaluation at each, with dropout; a patience that
    # never runs out, so the result is the best evaluation's adapter, which the resumed run must know.
    settings = config(
        n_epochs=2, batch_size=4, lora_dropout=0.1, learning_rate=2e-3, evals_per_epoch=3, checkpoints_per_epoch=3,
        early_stopping_patience=100,
    )
    unbroken = Recorder()
    full = train(settings, SHORT_EXAMPLES, UNLEARNED, tmp_path / "unbroken", unbroken)
    interrupted = Recorder(stop_after_steps=2)  # the worker "dies" after step 2, within epoch 1
    train(settings, SHORT_EXAMPLES, UNLEARNED, tmp_path / "interrupted", interrupted)
    resumed = Recorder()
    checkpoint = tmp_path / "interrupted" / "checkpoints" / "step-2"
    result = train(settings, SHORT_EXAMPLES, UNLEARNED, tmp_path / "resumed", resumed, resume_from=checkpoint)

    assert [m.step for m in resumed.steps] == [3, 4, 5, 6]
    assert [m.train_loss for m in resumed.steps] == [m.train_loss for m in unbroken.steps[2:]]
    assert resumed.steps[-1].trained_tokens == unbroken.steps[-1].trained_tokens
    assert (result.best_step, result.final_valid_loss) == (full.best_step, full.final_valid_loss)
    expected, actual = _adapter_weights(full.adapter_dir), _adapter_weights(result.adapter_dir)
    assert all(torch.equal(expected[name], actual[name]) for name in expected)
