"""The combined adapter of a mix equals the sum of its parts' scaled LoRA deltas (``core.lora_algebra``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from core.lora_algebra import CannotMix, Part, combine, read_tensors, write_combined
from tests.lora_adapters import FAN_IN, FAN_OUT, PREFIX, _adapter, _delta


def test_it_equals_the_sum_of_the_scaled_deltas_of_adapters_of_different_ranks_alphas_and_modules(tmp_path):
    first = _adapter(tmp_path / "a", seed=1, rank=8, alpha=16, modules=["q_proj", "v_proj"])
    second = _adapter(tmp_path / "b", seed=2, rank=4, alpha=4, modules=["q_proj", "o_proj"], dtype=torch.bfloat16)
    third = _adapter(tmp_path / "c", seed=3, rank=2, alpha=8, modules=["v_proj"], use_rslora=True)
    parts = [Part(first, 0.5), Part(second, -1.25), Part(third, 2.0)]
    config, tensors = combine(parts)
    assert config["r"] == config["lora_alpha"] == 14 and not config["use_rslora"]
    assert config["target_modules"] == ["o_proj", "q_proj", "v_proj"]
    for module in ("q_proj", "v_proj", "o_proj"):
        a, b = tensors[f"{PREFIX}.{module}.lora_A.weight"], tensors[f"{PREFIX}.{module}.lora_B.weight"]
        assert a.shape == (14, FAN_IN) and b.shape == (FAN_OUT, 14) and a.dtype == np.float32
        expected = sum(part.scale * _delta(part.folder, module) for part in parts)
        np.testing.assert_allclose(b.astype(np.float64) @ a, expected, rtol=1e-5, atol=1e-5)


def test_it_reads_bfloat16_weights_exactly(tmp_path):
    values = torch.tensor([[1.5, -0.0078125], [3.0e10, -2.0]], dtype=torch.bfloat16)
    save_file({"w": values}, str(tmp_path / "w.safetensors"))
    np.testing.assert_array_equal(read_tensors(tmp_path / "w.safetensors")["w"], values.float().numpy())


def test_it_writes_a_loadable_adapter_once(tmp_path):
    part = Part(_adapter(tmp_path / "a", seed=1, rank=8, alpha=16, modules=["q_proj"]), 0.5)
    target = write_combined([part], tmp_path / "mixes" / "abc")
    assert json.loads((target / "adapter_config.json").read_text())["lora_alpha"] == 8
    written = read_tensors(target / "adapter_model.safetensors")
    np.testing.assert_allclose(
        written[f"{PREFIX}.q_proj.lora_B.weight"] @ written[f"{PREFIX}.q_proj.lora_A.weight"],
        0.5 * _delta(part.folder, "q_proj"), rtol=1e-5, atol=1e-5,
    )
    assert write_combined([part], target) == target and [p.name for p in target.parent.iterdir()] == ["abc"]


@pytest.mark.parametrize(
    "config, message",
    [({"use_dora": True}, "use_dora"), ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"), ({"bias": "all"}, "biases")],
)
def test_it_refuses_adapters_the_sum_does_not_cover(tmp_path, config, message):
    folder = _adapter(tmp_path / "a", seed=1, rank=8, alpha=16, modules=["q_proj"], **config)
    with pytest.raises(CannotMix, match=message):
        combine([Part(folder, 1.0)])
