"""The C kernel for multi-LoRA (``gemv.c``): built on first use, loaded with ctypes.

A decode batch whose 32 tokens use 32 adapters reads 32 adapters' weights at every projection: the
step's LoRA is bound by those bytes, not by arithmetic. Torch's batched products read them in
float32, after gathering the tokens into groups; this kernel reads each token's adapter once, in
half precision (half the bytes), in one call per projection: less than half the time of torch's
products on the catalog model (docs/lora-kernels.md; ``benchmarks/lora_kernels_replay.py``).

Half precision rounds each weight to 11 significant bits (a relative error of at most 2^-11; vLLM's
GPU kernels hold adapters in a half-precision model's dtype alike); the arithmetic stays float32. A
weight past half precision's range (65,504) would become infinite: ``HalfWeights.unfit_slots`` says
which slots hold one, and their tokens are computed without this kernel (``inference.engine.compute``),
the others' with it.

The library is built with the machine's C compiler into ``<DATA_DIR>/build``, named by a hash of
the source and flags, so an edited source is built again and a built one is only loaded. A machine
without a compiler, or a CPU without AVX2, FMA and F16C, gets ``Unavailable`` with the reason, and
``inference.engine.install`` picks torch's products instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SOURCE = Path(__file__).with_name("gemv.c")
Stacked = tuple["torch.Tensor", ...]  # vLLM's per-slice weights for every slot
# -fopenmp: the tokens are split among OpenMP threads. The library needs libgomp.so.1, which torch
# has loaded already (torch's own copy), so both share one OpenMP runtime and its thread pool.
_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
_CPU_FEATURES = ("avx2", "fma", "f16c")


class Unavailable(Exception):
    """Why this machine cannot run the C kernel."""


def load(build_dir: Path) -> LoraGemv:
    """The kernel, built first if no build of this source is in ``build_dir``."""
    missing = [feature for feature in _CPU_FEATURES if feature not in _cpu_flags()]
    if missing:
        raise Unavailable(f"this CPU lacks {', '.join(missing)}")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
    library = build_dir / f"lora_gemv-{digest}.so"
    if not library.exists():
        _build(library)
    try:
        return LoraGemv(ctypes.CDLL(str(library)))
    except (OSError, AttributeError) as exc:
        raise Unavailable(f"{library} does not load ({exc})") from None


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()  # not Linux: the flags are unknown, so the kernel is not used
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def _build(target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise Unavailable(f"no C compiler (cc) to build {SOURCE.name}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        try:
            result = subprocess.run(
                [compiler, *_FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True, timeout=300
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise Unavailable(f"{compiler} did not build {SOURCE.name} ({exc})") from None
        if result.returncode != 0:
            said = (result.stderr.strip().splitlines() or ["no message"])[-1]
            raise Unavailable(f"{compiler} could not build {SOURCE.name}: {said}")
        os.replace(built, target)  # whole or absent: another replica may be building it at the same moment


class LoraGemv:
    """``y[t] += sum_k scale * w[t,k] * x[t] @ A[s[t,k]] @ B[s[t,k]]`` over each token's parts whose
    slot is not negative (one part of weight 1 for a plain adapter)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        self._function = library.lora_gemv
        self._function.argtypes = [pointer, size, pointer, size, pointer, pointer, size, size,
                                   pointer, pointer, size, size, size, pointer, ctypes.c_float]
        self._function.restype = None
        self._to_half = library.to_half
        self._to_half.argtypes = [pointer, size, size, pointer, size, size, size, size]
        self._to_half.restype = size
        self._to_half_slots = library.to_half_slots
        self._to_half_slots.argtypes = [pointer, size, pointer, size, pointer]
        self._to_half_slots.restype = None

    @staticmethod
    def accepts(y: torch.Tensor, x: torch.Tensor) -> bool:
        """Whether these are what the kernel reads and writes: float32 row-major matrices in host
        memory (checked at every call: vLLM may hand a layer other activations)."""
        import torch

        return (
            y.dim() == x.dim() == 2
            and y.stride(1) == x.stride(1) == 1
            and y.dtype == x.dtype == torch.float32
            and y.device.type == x.device.type == "cpu"
        )

    @staticmethod
    def reads(*weights: torch.Tensor) -> bool:
        """Whether vLLM's stacked adapter weights are what the kernel's layout is copied from:
        float32 (the model's dtype) in host memory (checked once per layer, when it is prepared)."""
        import torch

        return all(tensor.dtype == torch.float32 and tensor.device.type == "cpu" for tensor in weights)

    def add(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        token_slots: torch.Tensor,
        weights: HalfWeights,
        scale: float,
        token_weights: torch.Tensor | None = None,
    ) -> None:
        """``token_slots``: int64, contiguous, from the first row of ``x`` and ``y``: one slot per
        token, or tokens x parts slots (a mix's parts; -1: none). ``token_weights``: float32,
        contiguous, the same shape: each part's weight (times ``scale``); None: ``scale`` alone."""
        parts = token_slots.size(1) if token_slots.dim() == 2 else 1
        self._function(
            y.data_ptr(), y.stride(0), x.data_ptr(), x.stride(0), token_slots.data_ptr(),
            None if token_weights is None else token_weights.data_ptr(), parts, token_slots.size(0),
            weights.a.data_ptr(), weights.b.data_ptr(), weights.a.size(2), weights.rank,
            weights.offsets.numel() - 1, weights.offsets.data_ptr(), scale,
        )

    def prepare(
        self,
        lora_a_stacked: Stacked,
        lora_b_stacked: Stacked,
        rank: int,
        slot_state: tuple[tuple[object, int], ...],
    ) -> HalfWeights:
        """Every slot's weights, from vLLM's layout (per slice, A slots x 1 x max_rank x in, B slots x
        1 x out x max_rank), up to ``rank``."""
        import torch

        slots, fan_in = lora_a_stacked[0].size(0), lora_a_stacked[0].size(3)
        ends = list(itertools.accumulate(lora_b.size(2) for lora_b in lora_b_stacked))
        a = torch.empty(slots, len(lora_a_stacked) * rank, fan_in, dtype=torch.float16)
        b = torch.empty(slots, rank, ends[-1], dtype=torch.float16)
        offsets = torch.tensor([0, *ends], dtype=torch.int64)
        weights = HalfWeights(
            self,
            lora_a_stacked[0],
            rank,
            slot_state,
            a,
            b,
            offsets,
            set(),
            _copy_table(a, b, offsets, lora_a_stacked, lora_b_stacked, rank),
        )
        weights.copy_slots(list(range(slots)))
        return weights

    def to_half_slots(self, table: torch.Tensor, slots: list[int]) -> list[int]:
        """Copy these slots of every matrix ``table`` lists (``_copy_table``) in one call: how many
        values of each slot became infinite."""
        import torch

        chosen = torch.tensor(slots, dtype=torch.int64)
        infinite = torch.zeros(len(slots), dtype=torch.int64)
        self._to_half_slots(table.data_ptr(), table.size(0), chosen.data_ptr(), len(slots), infinite.data_ptr())
        return infinite.tolist()

    def to_half(self, target: torch.Tensor, source: torch.Tensor) -> int:
        """Copy the float32 matrix ``source`` into the float16 ``target`` (same shape, any strides):
        how many values became infinite."""
        import torch

        kinds = (source.dtype, target.dtype)
        if target.dim() != 2 or target.shape != source.shape or kinds != (torch.float32, torch.float16):
            got = f"{source.dtype} {list(source.shape)} into {target.dtype} {list(target.shape)}"
            raise ValueError(f"to_half copies float32 into float16 of the same shape, not {got}")
        return int(self._to_half(
            target.data_ptr(), target.stride(0), target.stride(1),
            source.data_ptr(), source.stride(0), source.stride(1), source.size(0), source.size(1),
        ))


@dataclass
class HalfWeights:
    """One projection's adapter weights, every slot, in the kernel's layout (``gemv.c``)."""

    gemv: LoraGemv  # which converts them
    source: torch.Tensor  # vLLM's stacked A of the first slice: another tensor means another layer
    rank: int
    slot_state: tuple[tuple[object, int], ...]  # what was in each slot when it was copied
    a: torch.Tensor  # slots x (slices*rank) x in, float16
    b: torch.Tensor  # slots x rank x out, float16, the slices side by side
    offsets: torch.Tensor  # int64: slice i's columns of b are offsets[i]..offsets[i+1]
    unfit_slots: set[int]  # slots with a weight past half precision's range
    copy_table: torch.Tensor  # what a slot's copy from vLLM's layout reads and writes (``_copy_table``)

    @property
    def fits(self) -> bool:
        return not self.unfit_slots

    def copy_slots(self, slots: list[int]) -> None:
        """Copy these slots again from vLLM's layout: one C call."""
        for slot, infinite in zip(slots, self.gemv.to_half_slots(self.copy_table, slots)):
            if infinite:
                self.unfit_slots.add(slot)
            else:
                self.unfit_slots.discard(slot)


def _copy_table(
    a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, lora_a_stacked: Stacked, lora_b_stacked: Stacked, rank: int
) -> torch.Tensor:
    """For ``to_half_slots``: slot 0's matrices, each slice's A and B, as (target, its slot stride,
    row and column strides, source, likewise, rows, columns); slot s is s slot strides further. B
    goes row by row of vLLM's (out x rank): its reads are in order, the writes go to rank rows.
    The tensors are the layer's own, alive as long as the prepared weights are (``HalfWeights.source``)."""
    import torch

    rows = []
    ends = offsets.tolist()
    for number, (lora_a, lora_b) in enumerate(zip(lora_a_stacked, lora_b_stacked)):
        for target, source, slot_strides in (
            (a[0, number * rank : (number + 1) * rank], lora_a[0, 0, :rank], (a.stride(0), lora_a.stride(0))),
            (b[0, :, ends[number] : ends[number + 1]].t(), lora_b[0, 0, :, :rank], (b.stride(0), lora_b.stride(0))),
        ):
            rows.append([
                target.data_ptr(), slot_strides[0], target.stride(0), target.stride(1),
                source.data_ptr(), slot_strides[1], source.stride(0), source.stride(1), *source.shape,
            ])
    return torch.tensor(rows, dtype=torch.int64)
