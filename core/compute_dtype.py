"""The dtype this machine computes a model in well, for a new catalog entry's engine.

On a GPU that torch finds: bfloat16 where the GPU has it (Ampere and later), else float16. On a CPU:
bfloat16 only with native bf16 matrix instructions (AVX512-BF16 or AMX); without them the CPU emulates
bf16, and float32 measured about 3x faster in vLLM here (the catalog's note on its dtype), 15-20x in
training (``workers/training/model.py``). Asked of torch, so no CPU is written down.

The platform's CPU LoRA kernels (``inference.engine``), mixes computed in the kernel among them,
take float32 only: a bfloat16 replica serves adapters with vLLM's own kernels and gets mixes built
as adapters. An operator who wants those on a bf16 CPU asks for float32 (``asked``).
"""

from __future__ import annotations

from dataclasses import dataclass


# What a catalog entry's engine.dtype may be: vLLM's --dtype spellings of the three it computes in.
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ComputeDtype:
    dtype: str  # as vLLM's --dtype and the catalog's engine.dtype spell it
    why: str  # one line for the operator: what was found


def asked(dtype: str) -> ComputeDtype:
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return ComputeDtype(dtype, "as asked")


def compute_dtype() -> ComputeDtype:
    import torch  # seconds to import: only when asked

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        if torch.cuda.is_bf16_supported():
            return ComputeDtype("bfloat16", f"GPU {name} computes in bfloat16")
        return ComputeDtype("float16", f"GPU {name} has no bfloat16")
    if _cpu_has_native_bf16(torch):
        return ComputeDtype("bfloat16", "CPU with native bfloat16 matrix instructions (AVX512-BF16 or AMX)")
    return ComputeDtype("float32", "CPU without AVX512-BF16 or AMX: bfloat16 would be emulated, float32 is faster")


def _cpu_has_native_bf16(torch: object) -> bool:
    # torch.cpu's own probes (cpuinfo underneath); private, so a torch without them reads as "no".
    cpu = getattr(torch, "cpu", None)
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, probe, lambda: False)()) for probe in probes)
