"""Composition's approximations (``core.lora_merge``): SVD truncation is the best low-rank sum, TIES
and DARE are PEFT's, and each reports its distance from the exact sum."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peft.utils import merge_utils

from core.lora_algebra import Part
from core.lora_merge import full_rank, merge
from tests.lora_adapters import PREFIX, _adapter, _delta

MODULES = ("q_proj", "v_proj", "o_proj")


@pytest.fixture
def parts(tmp_path) -> list[Part]:
    first = _adapter(tmp_path / "a", seed=1, rank=4, alpha=8, modules=["q_proj", "v_proj"])
    second = _adapter(tmp_path / "b", seed=2, rank=4, alpha=4, modules=["q_proj", "o_proj"])
    third = _adapter(tmp_path / "c", seed=3, rank=2, alpha=8, modules=["v_proj"], use_rslora=True)
    return [Part(first, 0.5), Part(second, -1.25), Part(third, 2.0)]


def _exact(parts: list[Part], module: str) -> np.ndarray:
    return sum(part.scale * _delta(part.folder, module) for part in parts)


def _served(merged, module: str) -> np.ndarray:
    # the merged adapter's scaling is 1 (lora_alpha == r): B @ A is what it adds
    assert merged.config["lora_alpha"] == merged.config["r"] == merged.rank
    a, b = merged.tensors[f"{PREFIX}.{module}.lora_A.weight"], merged.tensors[f"{PREFIX}.{module}.lora_B.weight"]
    assert a.shape[0] == b.shape[1] == merged.rank
    return b.astype(np.float64) @ a


def _relative_error(parts: list[Part], merged) -> float:
    error = sum(np.sum((_served(merged, m) - _exact(parts, m)) ** 2) for m in MODULES)
    return float(np.sqrt(error / sum(np.sum(_exact(parts, m) ** 2) for m in MODULES)))


def test_linear_is_exact_at_the_sum_of_the_ranks(parts):
    merged = merge(parts, "linear", rank=full_rank(parts))
    assert merged.rank == 10 and merged.approximation_error == 0.0
    for module in MODULES:
        np.testing.assert_allclose(_served(merged, module), _exact(parts, module), atol=1e-5)


def test_svd_at_a_lower_rank_is_the_best_truncation_and_reports_its_error(parts):
    merged = merge(parts, "svd", rank=3)
    for module in MODULES:
        u, s, vt = np.linalg.svd(_exact(parts, module))
        best = (u[:, :3] * s[:3]) @ vt[:3]
        np.testing.assert_allclose(_served(merged, module), best, atol=1e-4)
    assert 0.05 < merged.approximation_error < 1
    assert merged.approximation_error == pytest.approx(_relative_error(parts, merged), rel=1e-4)


def test_svd_at_full_rank_loses_nothing(parts):
    merged = merge(parts, "svd", rank=10)
    assert merged.approximation_error < 1e-6
    for module in MODULES:
        np.testing.assert_allclose(_served(merged, module), _exact(parts, module), atol=1e-4)


def test_ties_is_pefts_ties_merge_of_the_deltas(parts):
    rank = 10  # the modules are 10 x 12: at rank 10 the truncation keeps everything, leaving TIES alone
    merged = merge(parts, "ties", rank=rank, density=0.4)
    weights = torch.tensor([part.scale for part in parts], dtype=torch.float64)
    for module in MODULES:
        deltas = [torch.from_numpy(_delta(part.folder, module)) for part in parts]
        expected = merge_utils.ties(deltas, weights, density=0.4).numpy()
        np.testing.assert_allclose(_served(merged, module), expected, atol=1e-4)
    assert merged.approximation_error == pytest.approx(_relative_error(parts, merged), rel=1e-4)
    assert merged.approximation_error > 0.1  # TIES changes the sum on purpose


def test_dare_keeps_a_density_share_of_each_delta_rescaled_and_is_repeatable_by_seed(tmp_path):
    only = [Part(_adapter(tmp_path / "a", seed=1, rank=4, alpha=4, modules=["q_proj"]), 1.0)]
    merged = merge(only, "dare_linear", rank=10, density=0.5, seed=7)
    served, delta = _served(merged, "q_proj"), _delta(only[0].folder, "q_proj")
    kept = np.abs(served) > 1e-4
    np.testing.assert_allclose(served[kept], 2 * delta[kept], rtol=1e-3, atol=1e-4)  # each kept entry / 0.5
    assert 0.3 < kept.mean() < 0.7
    again = merge(only, "dare_linear", rank=10, density=0.5, seed=7)
    np.testing.assert_array_equal(_served(again, "q_proj"), served)
    other_seed = merge(only, "dare_linear", rank=10, density=0.5, seed=8)
    assert not np.allclose(_served(other_seed, "q_proj"), served)


def test_a_lower_rank_approximation_pads_every_module_to_the_adapters_rank(tmp_path):
    small = [Part(_adapter(tmp_path / "a", seed=1, rank=2, alpha=2, modules=["q_proj"]), 1.0)]
    merged = merge(small, "svd", rank=6)  # more than the sum has: zero rows and columns
    a = merged.tensors[f"{PREFIX}.q_proj.lora_A.weight"]
    assert a.shape == (6, 12) and not a[2:].any()
    assert merged.approximation_error < 1e-6
