"""The engine of a step-by-step training run (the Tinker API's semantics) on the real base model: its
log-probabilities, its three losses, gradient accumulation, Adam steps, saved and loaded state, and
the checks on a request's inputs.

One model is loaded for the file; each test starts from its freshly initialised adapter and
optimizer (the ``model`` fixture). Sequences are a dozen tokens and runs a few steps, so the file
stays quick on two shared cores.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.environment import ROOT
from workers.training_loop.losses import LossInputError
from workers.training_loop.loop_model import (
    LORA_ALPHA, OPTIMIZER_FILE, AdamStep, LoopModel, LoraShape, LossInput, target_modules,
)
from workers.training_loop.shared_prefix import trees

pytestmark = [
    pytest.mark.training,
    # PEFT looks the adapter's base model id up to see whether its vocabulary changed; offline it says it cannot.
    pytest.mark.filterwarnings("ignore:Could not find a config file"),
]

BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
BASE_MODEL_PATH = ROOT / "data" / "models" / BASE_MODEL_ID
RANK = 8
ALL_PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
# Token ids of a short made-up text, and a shorter one: the two are packed into one forward pass.
LONG = [504, 3458, 282, 260, 2365, 314, 253, 1345, 28, 357, 2077, 30, 216]
SHORT = [1064, 314, 5248, 17, 9, 216, 42]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoopModel, Path]:
    """The file's model, and its state as loaded: loading takes seconds, restoring it a fraction."""
    model = LoopModel(str(BASE_MODEL_PATH), BASE_MODEL_ID, LoraShape(RANK, seed=0))
    return model, model.save_state(tmp_path_factory.mktemp("loop") / "initial")


@pytest.fixture
def model(loaded: tuple[LoopModel, Path]) -> LoopModel:
    """The file's model with its fresh adapter and optimizer back, and no gradients."""
    model, initial = loaded
    model.load_state(initial, with_optimizer=True)
    return model


def supervised(tokens: list[int], weights: list[float] | None = None) -> LossInput:
    """Next-token prediction over ``tokens``: the input is all but the last, the targets all but the first."""
    n = len(tokens) - 1
    return LossInput(tokens[:-1], {
        "target_tokens": np.array(tokens[1:], dtype=np.int64),
        "weights": np.array(weights if weights is not None else [1.0] * n, dtype=np.float32),
    })


def reinforced(tokens: list[int], sampling_logprobs: np.ndarray, advantages: list[float]) -> LossInput:
    return LossInput(tokens[:-1], {
        "target_tokens": np.array(tokens[1:], dtype=np.int64),
        "logprobs": np.asarray(sampling_logprobs, dtype=np.float32),
        "advantages": np.array(advantages, dtype=np.float32),
    })


def current_logprobs(model: LoopModel, tokens: list[int]) -> np.ndarray:
    return model.forward_backward([supervised(tokens)], "cross_entropy", None, forward_only=True).logprobs[0]


def adapter_weights(model: LoopModel) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.peft_model.named_parameters() if p.requires_grad}


def gradients(model: LoopModel) -> dict[str, torch.Tensor | None]:
    trainable = model.peft_model.named_parameters()
    return {name: None if p.grad is None else p.grad.clone() for name, p in trainable if p.requires_grad}


def assert_same_weights(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert left.keys() == right.keys()
    worst = max((a - right[name]).abs().max().item() for name, a in left.items())
    assert worst <= atol, f"the adapters differ by up to {worst}"


def test_it_gives_the_base_models_logprobs_at_init(model: LoopModel) -> None:
    weights = [0.0] * 6 + [1.0, 0.5, 2.0, 1.0, 1.0, 0.0]  # weight 0 on what a prompt would be
    result = model.forward_backward([supervised(LONG, weights), supervised(SHORT)], "cross_entropy", None)

    # The fresh adapter's B matrices are zero: the model is the base model, computed one datum at a time.
    with torch.no_grad(), model.peft_model.disable_adapter():
        expected = [
            torch.log_softmax(model.peft_model(input_ids=torch.tensor([tokens[:-1]])).logits[0], dim=-1)
            .gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy()
            for tokens in (LONG, SHORT)
        ]
    for got, want in zip(result.logprobs, expected, strict=True):
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-4)
    loss = -(np.array(weights) * result.logprobs[0]).sum() - result.logprobs[1].sum()
    assert result.metrics["loss:sum"] == pytest.approx(loss, rel=1e-5)


def test_it_lowers_the_loss_of_what_it_trains_on(model: LoopModel) -> None:
    before = model.forward_backward([supervised(LONG)], "cross_entropy", None, forward_only=True).metrics["loss:sum"]
    for _ in range(3):
        model.forward_backward([supervised(LONG)], "cross_entropy", None)
        assert model.optim_step(AdamStep(learning_rate=1e-3))["grad_norm"] > 0
    after = model.forward_backward([supervised(LONG)], "cross_entropy", None, forward_only=True).metrics["loss:sum"]
    assert after < 0.8 * before


def test_it_accumulates_gradients_until_the_step(model: LoopModel, loaded: tuple[LoopModel, Path]) -> None:
    # A large eps makes Adam's first step proportional to the gradient (lr * g / (|g| + eps)) rather
    # than its sign, so rounding differences between the two ways do not flip near-zero elements.
    step = AdamStep(learning_rate=1e-2, eps=1.0)
    model.forward_backward([supervised(LONG)], "cross_entropy", None)
    model.forward_backward([supervised(SHORT)], "cross_entropy", None)
    in_halves = gradients(model)
    halves_norm = model.optim_step(step)["grad_norm"]
    stepped_in_halves = adapter_weights(model)

    model.load_state(loaded[1], with_optimizer=True)
    model.forward_backward([supervised(LONG), supervised(SHORT)], "cross_entropy", None)
    whole = gradients(model)
    whole_norm = model.optim_step(step)["grad_norm"]

    # Two passes and one packed pass round differently: equal to a small fraction of each gradient's scale.
    for name, grad in whole.items():
        halves = in_halves[name]
        assert grad is not None and halves is not None, name
        assert (grad - halves).abs().max() <= 1e-3 * halves.abs().max(), name
    assert halves_norm == pytest.approx(whole_norm, rel=1e-5)
    # No element moves more than the learning rate: both agree to a thousandth of that.
    assert_same_weights(adapter_weights(model), stepped_in_halves, atol=1e-3 * step.learning_rate)


def test_answers_to_one_prompt_computed_once_as_a_tree_get_what_each_gets_alone(model: LoopModel) -> None:
    # A step first, so the adapter is no longer the base model and every LoRA matrix has a gradient.
    model.forward_backward([supervised(LONG)], "cross_entropy", None)
    model.optim_step(AdamStep(learning_rate=1e-2))
    answers = [LONG + [28, 357, 30], LONG + [2077], LONG + [28, 5248, 17, 9, 216]]  # one prompt, three answers
    data = [*(supervised(tokens, [0.0] * 12 + [1.0] * (len(tokens) - 13)) for tokens in answers), supervised(SHORT)]

    together = model.forward_backward(data, "cross_entropy", None)
    tree_grads = gradients(model)
    alone = [model.forward_backward([datum], "cross_entropy", None) for datum in data]  # adds the same again

    for got, want in zip(together.logprobs, (result.logprobs[0] for result in alone), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)
    assert together.metrics["loss:sum"] == pytest.approx(sum(r.metrics["loss:sum"] for r in alone), rel=1e-5)
    for name, doubled in gradients(model).items():  # tree + each alone = twice the tree's, up to rounding
        tree = tree_grads[name]
        assert tree is not None and doubled is not None, name
        assert (doubled - 2 * tree).abs().max() <= 1e-3 * tree.abs().max(), name


def test_data_sharing_a_start_are_grouped_as_trees_within_a_rows_length() -> None:
    prompt = list(range(100, 112))
    data = [torch.tensor(tokens) for tokens in (prompt + [1, 2], SHORT, prompt + [3], prompt[:5] + [4], prompt + [1, 2])]

    laid = trees(data, max_tokens=64)
    assert sorted(tree.members for tree in laid) == [[0, 4, 2], [1], [3]]  # 5 shared tokens are too few
    (tree,) = [tree for tree in laid if len(tree.members) == 3]
    assert tree.shared == 12 and tree.length == 12 + 2 + 2 + 1
    for member, positions in zip(tree.members, tree.positions, strict=True):
        assert torch.equal(tree.tokens[positions], data[member])  # each datum's tokens, in its order
        assert torch.equal(tree.position_ids[positions], torch.arange(len(data[member])))
        seen = tree.mask[positions[-1]].nonzero()[:, 0]  # its last token sees its own tokens, no one else's
        assert torch.equal(seen, positions)
    narrow = trees(data, max_tokens=15)  # the third answer's 1 token and the 2 it unshares do not fit: a tree alone
    assert sorted(tree.members for tree in narrow) == [[0, 4], [1], [2], [3]]


def test_it_steps_with_no_gradient_and_zeroes_them_after(model: LoopModel) -> None:
    before = adapter_weights(model)
    assert model.optim_step(AdamStep())["grad_norm"] == 0.0
    assert_same_weights(adapter_weights(model), before)

    model.forward_backward([supervised(SHORT)], "cross_entropy", None)
    model.optim_step(AdamStep())
    assert all(grad is None for grad in gradients(model).values())


def test_forward_only_leaves_the_gradients_untouched(model: LoopModel) -> None:
    model.forward_backward([supervised(LONG)], "cross_entropy", None, forward_only=True)
    assert all(grad is None for grad in gradients(model).values())

    model.forward_backward([supervised(SHORT)], "cross_entropy", None)
    accumulated = gradients(model)
    model.forward_backward([supervised(LONG)], "cross_entropy", None, forward_only=True)
    for name, grad in gradients(model).items():
        assert grad is not None and torch.equal(grad, accumulated[name]), name


def test_importance_sampling_at_the_samplers_policy_weighs_each_advantage_by_one(model: LoopModel) -> None:
    advantages = [0.5, -1.0, 2.0, 0.0, 1.5, -0.25, 1.0, 0.0, -2.0, 0.75, 1.0, 3.0]
    result = model.forward_backward(
        [reinforced(LONG, current_logprobs(model, LONG), advantages)], "importance_sampling", None
    )
    assert result.metrics["ratio:mean"] == pytest.approx(1.0, abs=1e-5)
    assert result.metrics["loss:sum"] == pytest.approx(-sum(advantages), abs=1e-4)


def test_ppo_clips_the_ratio_where_the_advantage_pushes_it_further(model: LoopModel) -> None:
    # The sampler gave every token e^-0.5 of the current probability: the ratio is e^0.5 = 1.65 > 1.2.
    long_sampled, short_sampled = current_logprobs(model, LONG) - 0.5, current_logprobs(model, SHORT) - 0.5
    rewarded = reinforced(LONG, long_sampled, [1.0] * 12)  # would push the ratio higher: clipped to 1.2
    punished = reinforced(SHORT, short_sampled, [-1.0] * 6)  # would pull it back: not clipped
    ratio = math.exp(0.5)

    result = model.forward_backward([rewarded, punished], "ppo", None)
    assert result.metrics["loss:sum"] == pytest.approx(-(1.2 * 12) + ratio * 6, rel=1e-4)
    assert result.metrics["clipped:mean"] == pytest.approx(12 / 18)

    unclipped = model.forward_backward([rewarded], "ppo", {"clip_high_threshold": 2.0}, forward_only=True)
    assert unclipped.metrics["loss:sum"] == pytest.approx(-ratio * 12, rel=1e-4)


def test_ppo_gives_no_gradient_through_clipped_tokens(model: LoopModel) -> None:
    rewarded = reinforced(SHORT, current_logprobs(model, SHORT) - 0.5, [1.0] * 6)
    model.forward_backward([rewarded], "ppo", None)
    assert model.optim_step(AdamStep())["grad_norm"] == 0.0

    model.forward_backward([rewarded], "importance_sampling", None)
    assert model.optim_step(AdamStep())["grad_norm"] > 0.0


def test_save_state_then_load_state_goes_on_as_an_unbroken_run(model: LoopModel, tmp_path: Path) -> None:
    for _ in range(2):  # Adam's moments are not zero any more
        model.forward_backward([supervised(LONG)], "cross_entropy", None)
        model.optim_step(AdamStep(learning_rate=1e-3))
    saved = model.save_state(tmp_path / "state")
    model.forward_backward([supervised(LONG)], "cross_entropy", None)
    model.optim_step(AdamStep(learning_rate=1e-3))
    unbroken = adapter_weights(model)

    other = LoopModel(str(BASE_MODEL_PATH), BASE_MODEL_ID, LoraShape(RANK, seed=1))
    other.load_state(saved, with_optimizer=True)
    other.forward_backward([supervised(LONG)], "cross_entropy", None)
    other.optim_step(AdamStep(learning_rate=1e-3))
    assert_same_weights(adapter_weights(other), unbroken, atol=1e-7)

    # Without the optimizer the moments start afresh, and the same step lands elsewhere.
    other.load_state(saved, with_optimizer=False)
    other.forward_backward([supervised(LONG)], "cross_entropy", None)
    other.optim_step(AdamStep(learning_rate=1e-3))
    with pytest.raises(AssertionError):
        assert_same_weights(adapter_weights(other), unbroken, atol=1e-5)
    assert "optimizer" in torch.load(saved / OPTIMIZER_FILE, weights_only=True)


def test_save_adapter_writes_a_peft_adapter_named_by_the_base_models_id(model: LoopModel, tmp_path: Path) -> None:
    folder = model.save_adapter(tmp_path / "adapter")

    assert sorted(path.name for path in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == BASE_MODEL_ID
    assert config["r"] == RANK and config["lora_alpha"] == LORA_ALPHA
    assert set(config["target_modules"]) == ALL_PROJECTIONS


def test_load_state_refuses_an_adapter_of_another_rank(model: LoopModel, tmp_path: Path) -> None:
    folder = model.save_adapter(tmp_path / "adapter")
    config_file = folder / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "r": 16}))

    with pytest.raises(ValueError, match="rank 16, this run's is 8"):
        model.load_state(folder, with_optimizer=False)


def test_load_state_with_the_optimizer_needs_its_state(model: LoopModel, tmp_path: Path) -> None:
    folder = model.save_adapter(tmp_path / "adapter")
    with pytest.raises(ValueError, match="no optimizer state"):
        model.load_state(folder, with_optimizer=True)
    model.load_state(folder, with_optimizer=False)  # as sampler weights, it loads


def _inputs(datum: LossInput, **changed: object) -> LossInput:
    return LossInput(datum.tokens, {**datum.inputs, **changed})  # type: ignore[dict-item]


def _without(datum: LossInput, name: str) -> LossInput:
    return LossInput(datum.tokens, {key: value for key, value in datum.inputs.items() if key != name})


GOOD = reinforced(SHORT, np.full(6, -2.0), [1.0] * 6)
BAD_INPUTS = {
    "a short field": (_inputs(GOOD, advantages=np.ones(5)), "ppo", r"data\[2\]\.loss_fn_inputs\.advantages: 5 values for 6 tokens"),
    "a missing field": (_without(GOOD, "logprobs"), "ppo", r"data\[2\]\.loss_fn_inputs\.logprobs: missing"),
    "a target outside the vocabulary": (
        _inputs(GOOD, target_tokens=np.array([5, 6, 49152, 7, 8, 9])), "ppo",
        r"data\[2\]\.loss_fn_inputs\.target_tokens: token id 49152 at position 2 is outside the vocabulary",
    ),
    "a NaN": (_inputs(GOOD, logprobs=np.array([-1, -1, np.nan, -1, -1, -1.0])), "importance_sampling",
              r"data\[2\]\.loss_fn_inputs\.logprobs: holds NaN"),
    "float targets": (_inputs(GOOD, target_tokens=np.ones(6)), "ppo", r"data\[2\]\.loss_fn_inputs\.target_tokens: give integer"),
    "a model input outside the vocabulary": (
        LossInput([1, 2, 3, 4, 5, -1], GOOD.inputs), "ppo", r"data\[2\]\.model_input: token id -1 at position 5",
    ),
    "cross_entropy without weights": (GOOD, "cross_entropy", r"data\[0\]\.loss_fn_inputs\.weights: missing"),
    "an unknown loss": (GOOD, "dpo", r"loss_fn 'dpo' is not one of cross_entropy, importance_sampling, ppo"),
}


@pytest.mark.parametrize("bad, loss_fn, message", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_it_refuses_bad_inputs_naming_the_datum_and_field(
    model: LoopModel, bad: LossInput, loss_fn: str, message: str
) -> None:
    with pytest.raises(LossInputError, match=message):
        model.forward_backward([GOOD, GOOD, bad], loss_fn, None)
    assert all(grad is None for grad in gradients(model).values())  # refused before any forward


def test_it_refuses_a_misspelt_config_key(model: LoopModel) -> None:
    with pytest.raises(
        LossInputError, match=r"loss_fn_config\.clip_low: ppo takes clip_low_threshold, clip_high_threshold"
    ):
        model.forward_backward([GOOD], "ppo", {"clip_low": 0.9})


def test_the_lora_shape_picks_the_attention_the_mlp_or_both() -> None:
    layer = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    layer += [f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    names = [*layer, "lm_head"]
    assert set(target_modules(names, train_mlp=True, train_attn=True)) == ALL_PROJECTIONS
    assert target_modules(names, train_mlp=False, train_attn=True) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert target_modules(names, train_mlp=True, train_attn=False) == ["down_proj", "gate_proj", "up_proj"]
    with pytest.raises(ValueError, match="train_mlp or train_attn"):
        LoraShape(RANK, train_mlp=False, train_attn=False)
