"""The replicas' CPU LoRA kernels give vLLM's reference result: y[t] += x[t] @ A[i_t] @ B[i_t]."""

from __future__ import annotations

import types

import pytest
import torch

from inference import lora_kernels

FAN_IN, SLICES = 64, (64, 32, 32)  # a small fused q/k/v projection


def _stacked(slots: int, max_rank: int, ranks: list[int]):
    """vLLM's layout: per slice, A is slots x 1 x max_rank x in, B slots x 1 x out x max_rank, zero-padded."""
    generator = torch.Generator().manual_seed(0)
    lora_a = tuple(torch.zeros(slots, 1, max_rank, FAN_IN) for _ in SLICES)
    lora_b = tuple(torch.zeros(slots, 1, out, max_rank) for out in SLICES)
    for slot, rank in enumerate(ranks):
        for a, b in zip(lora_a, lora_b):
            a[slot, 0, :rank] = torch.randn(rank, FAN_IN, generator=generator)
            b[slot, 0, :, :rank] = torch.randn(b.shape[2], rank, generator=generator)
    return lora_a, lora_b


def _reference(x, lora_a, lora_b, indices):
    y = torch.zeros(x.size(0), sum(SLICES))
    offset = 0
    for a, b, out in zip(lora_a, lora_b, SLICES):
        for token, slot in enumerate(indices.tolist()):
            if slot >= 0:
                y[token, offset : offset + out] += x[token] @ a[slot, 0].t() @ b[slot, 0].t()
        offset += out
    return y


@pytest.mark.parametrize(
    "ranks, indices",
    [
        ([8, 8, 8, 8], [0, 1, -1, 3, 2, 0, -1]),  # every slot, tokens without an adapter
        ([8, 16, 4, 8], [2, 2, -1, 0, 2]),  # some slots: computed up to their largest rank only
        ([8, 16, 4, 8], [1, -1, 1]),  # one slot of full rank
    ],
)
def test_it_matches_the_reference_per_token_computation(ranks, indices):
    lora_a, lora_b = _stacked(slots=4, max_rank=16, ranks=ranks)
    ids = [101, 102, 103, 104]  # vLLM's adapter ids in the slots
    lora_kernels._RANKS.update(zip(ids, ranks))
    indices = torch.tensor(indices)
    x = torch.randn(len(indices), FAN_IN, generator=torch.Generator().manual_seed(1))
    wrapper = types.SimpleNamespace(_fineserve_step=lora_kernels._plan(indices, ids), _fineserve_prepared={})
    y = torch.zeros(len(indices), sum(SLICES))
    lora_kernels._dense_add_lora_linear(wrapper, y, x, lora_a, lora_b, 1.0, SLICES)
    torch.testing.assert_close(y, _reference(x, lora_a, lora_b, indices), rtol=1e-4, atol=1e-4)


def test_it_skips_batches_without_adapters():
    assert lora_kernels._plan(torch.tensor([-1, -1, -1]), [101, 102]) is None
    wrapper = types.SimpleNamespace(_fineserve_step=None, _fineserve_prepared={})
    y = torch.ones(3, sum(SLICES))
    lora_kernels._dense_add_lora_linear(wrapper, y, torch.randn(3, FAN_IN), *_stacked(2, 8, [8, 8]), 1.0, SLICES)
    assert torch.equal(y, torch.ones(3, sum(SLICES)))


def test_it_prepares_weights_once_and_again_when_a_slot_gets_new_weights():
    lora_a, lora_b = _stacked(slots=2, max_rank=8, ranks=[8, 8])
    ids, indices = [201, 202], torch.tensor([0, 1, 1])
    lora_kernels._RANKS.update(zip(ids, [8, 8]))
    wrapper = types.SimpleNamespace(_fineserve_prepared={})
    x = torch.randn(3, FAN_IN, generator=torch.Generator().manual_seed(2))

    def apply() -> torch.Tensor:
        wrapper._fineserve_step = lora_kernels._plan(indices, ids)
        y = torch.zeros(3, sum(SLICES))
        lora_kernels._dense_add_lora_linear(wrapper, y, x, lora_a, lora_b, 1.0, SLICES)
        return y

    first = apply()
    prepared = next(iter(wrapper._fineserve_prepared.values()))[2]
    apply()
    assert next(iter(wrapper._fineserve_prepared.values()))[2] is prepared  # reused, not rebuilt
    for a in lora_a:
        a[1].mul_(2)  # vLLM writes other weights into slot 1 (activating an adapter there)...
    lora_kernels._generation += 1  # ...which the patched activate_adapter records
    torch.testing.assert_close(apply(), _reference(x, lora_a, lora_b, indices), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(apply(), first)
