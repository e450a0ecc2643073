"""One LoRA adapter from a weighted combination of others: exact, or approximated to a rank.

Methods, for adapters ``i`` with weights ``w_i`` and deltas ``D_i = scaling_i * B_i @ A_i``:

- ``linear``: exactly ``sum w_i D_i`` (``core.lora_algebra.combine``); its rank is the sum of the
  ranks, so it may be more than the deployment serves.
- ``svd``: that exact sum, truncated by SVD to ``rank``: the closest adapter of that rank (in
  Frobenius norm, module by module). Computed from the factors (QR of the stacked ``B`` and ``A``),
  so no full matrix is formed.
- ``ties`` and ``dare_linear``: PEFT's merges of the same names (``peft.utils.merge_utils``, here in
  NumPy so the web process needs no torch) on each module's full deltas, then truncated by SVD to
  ``rank``: PEFT's ``ties_svd`` and ``dare_linear_svd``. TIES keeps each delta's ``density``
  largest entries, elects a sign per entry, and averages the weighted entries that agree with it;
  DARE drops entries at random (seeded) and rescales the rest by ``1 / density``. They change the
  sum on purpose (to reduce interference between adapters), so their error counts that change too.

Each result reports ``approximation_error``: ``||merged - exact||_F / ||exact||_F`` over all adapted
modules (0 for ``linear``), where ``exact`` is the linear sum.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from core.adapter_check import Architecture
from core.lora_algebra import LoadedPart, Part, adapter_config, combine, load, modules_of, rank_of, weight_names

Method = Literal["linear", "svd", "ties", "dare_linear"]
METHODS: tuple[Method, ...] = ("linear", "svd", "ties", "dare_linear")
_OVERSAMPLE, _POWER_ITERATIONS = 8, 2  # randomized SVD: close to the exact truncation at a few matmuls' cost
# A merged adapter's size beyond its weights: each tensor's entry in the safetensors header (its
# name, dtype, shape and offsets: about 130 bytes for PEFT's names), and adapter_config.json.
_FLOAT32_BYTES, _HEADER_BYTES_PER_TENSOR, _CONFIG_BYTES = 4, 256, 8192


@dataclass(frozen=True)
class Merged:
    config: dict
    tensors: dict[str, np.ndarray]
    rank: int
    approximation_error: float


def most_bytes(architecture: Architecture, target_modules: Iterable[str], rank: int) -> int:
    """The most an adapter of ``rank`` on ``target_modules`` of every layer can take, as ``merge``
    writes it (float32 A and B matrices, a safetensors header, a config): known from the base
    model's shapes before any weight is read, so a composition is measured against a quota first."""
    per_layer = sum(sum(architecture.linear(module)) for module in set(target_modules))
    weights = _FLOAT32_BYTES * rank * per_layer * architecture.layers
    tensors = 2 * len(set(target_modules)) * architecture.layers  # an A and a B per module of each layer
    return weights + tensors * _HEADER_BYTES_PER_TENSOR + _CONFIG_BYTES


def full_rank(parts: list[Part]) -> int:
    """The rank of the exact combination: the sum of the parts' ranks."""
    return sum(rank_of(part.folder) for part in parts)


def merge(parts: list[Part], method: Method, rank: int, density: float = 0.5, seed: int = 0) -> Merged:
    """``parts``' adapters combined by ``method``; ``rank`` is the result's, unless ``linear`` (the
    sum of the ranks). ``density`` and ``seed`` matter to ``ties`` and ``dare_linear`` only."""
    if method == "linear":
        config, summed = combine(parts)
        return Merged(config, summed, config["r"], 0.0)
    loaded = load(parts)
    modules = modules_of(loaded)
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    error_squared = exact_squared = 0.0
    for module, (fan_in, fan_out) in modules.items():
        if method == "svd":
            b, a, error, norm = _truncated_exact_sum(loaded, module, fan_in, fan_out, rank)
        else:
            exact = _exact_sum(loaded, module, fan_in, fan_out)
            merged = _sparse_merge(loaded, module, fan_in, fan_out, method, density, rng)
            b, a = _truncated(merged, rank, rng)
            error, norm = float(np.linalg.norm(b @ a - exact)), float(np.linalg.norm(exact))
        name_a, name_b = weight_names(module)
        tensors[name_a], tensors[name_b] = np.ascontiguousarray(a), np.ascontiguousarray(b)
        error_squared += error**2
        exact_squared += norm**2
    relative = math.sqrt(error_squared / exact_squared) if exact_squared else 0.0
    return Merged(adapter_config(loaded, list(modules), rank), tensors, rank, relative)


def _stacked_factors(loaded: list[LoadedPart], module: str, fan_in: int, fan_out: int) -> tuple[np.ndarray, np.ndarray]:
    """(B, A) with ``B @ A`` the exact weighted sum (float64: the QR and SVD below want it)."""
    factors = [part.factors(module, fan_in, fan_out) for part in loaded]
    a = np.concatenate([part.scale * a.astype(np.float64) for part, (a, _) in zip(loaded, factors)], axis=0)
    b = np.concatenate([b.astype(np.float64) for _, b in factors], axis=1)
    return b, a


def _exact_sum(loaded: list[LoadedPart], module: str, fan_in: int, fan_out: int) -> np.ndarray:
    b, a = _stacked_factors(loaded, module, fan_in, fan_out)
    return b.astype(np.float32) @ a.astype(np.float32)


def _truncated_exact_sum(
    loaded: list[LoadedPart], module: str, fan_in: int, fan_out: int, rank: int
) -> tuple[np.ndarray, np.ndarray, float, float]:
    """The best rank-``rank`` (B, A) of ``B @ A`` without forming it: with ``B = Qb Rb`` and
    ``A^T = Qa Ra``, ``B @ A = Qb (Rb Ra^T) Qa^T``, and only the small core needs an SVD. Returns the
    error and the exact sum's norm too, from the core's singular values."""
    b, a = _stacked_factors(loaded, module, fan_in, fan_out)
    q_b, r_b = np.linalg.qr(b)
    q_a, r_a = np.linalg.qr(a.T)
    u, s, vt = np.linalg.svd(r_b @ r_a.T)
    kept = min(rank, len(s))
    root = np.sqrt(s[:kept])
    new_b = _pad_columns((q_b @ u[:, :kept]) * root, rank)
    new_a = _pad_rows((root[:, None] * vt[:kept]) @ q_a.T, rank)
    error, norm = float(np.sqrt(np.sum(s[kept:] ** 2))), float(np.linalg.norm(s))
    return new_b.astype(np.float32), new_a.astype(np.float32), error, norm


def _sparse_merge(
    loaded: list[LoadedPart], module: str, fan_in: int, fan_out: int, method: Method, density: float,
    rng: np.random.Generator,
) -> np.ndarray:
    """PEFT's ``ties`` or ``dare_linear`` of the parts' deltas of ``module``, weighted by their scales.
    In float32, as the adapters are stored: these are full matrices, hundreds per model."""
    deltas = []
    for part in loaded:
        a, b = part.factors(module, fan_in, fan_out)
        deltas.append(b @ a)
    weights = np.array([part.scale for part in loaded], np.float32)[:, None, None]
    if method == "dare_linear":
        kept = [delta * (rng.random(delta.shape, dtype=np.float32) < density) for delta in deltas]
        return np.sum(np.stack(kept) * weights, axis=0) / np.float32(density)
    trimmed = np.stack([_keep_largest(delta, density) for delta in deltas])
    # sign election on the trimmed, unweighted deltas ("total": the sign of their sum), as PEFT does
    agrees = np.sign(trimmed) == np.where(trimmed.sum(axis=0) >= 0, np.float32(1), np.float32(-1))
    return (trimmed * weights * agrees).sum(axis=0) / np.maximum(agrees.sum(axis=0), 1).astype(np.float32)


def _keep_largest(delta: np.ndarray, density: float) -> np.ndarray:
    """``delta`` with all but its ``density`` share of largest-magnitude entries set to 0."""
    keep = int(density * delta.size)
    if keep >= delta.size:
        return delta
    flat = np.abs(delta).ravel()
    mask = np.zeros(delta.size, dtype=bool)
    if keep > 0:
        mask[np.argpartition(flat, delta.size - keep)[delta.size - keep :]] = True
    return delta * mask.reshape(delta.shape)


def _truncated(matrix: np.ndarray, rank: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(B, A), ``rank`` columns and rows, with ``B @ A`` close to the best rank-``rank`` approximation
    of ``matrix``: a randomized SVD (Halko et al.), a full SVD of each module being too slow for a
    request (about 0.3 s for one 576 x 1536 matrix on a 2-core machine, and a model has hundreds)."""
    sketch = min(rank + _OVERSAMPLE, *matrix.shape)
    q, _ = np.linalg.qr(matrix @ rng.standard_normal((matrix.shape[1], sketch), dtype=np.float32))
    for _ in range(_POWER_ITERATIONS):
        q, _ = np.linalg.qr(matrix.T @ q)
        q, _ = np.linalg.qr(matrix @ q)
    u, s, vt = np.linalg.svd(q.T @ matrix, full_matrices=False)
    kept = min(rank, len(s))
    root = np.sqrt(s[:kept])
    b = _pad_columns((q @ u[:, :kept]) * root, rank)
    a = _pad_rows(root[:, None] * vt[:kept], rank)
    return b.astype(np.float32), a.astype(np.float32)


def _pad_columns(matrix: np.ndarray, width: int) -> np.ndarray:
    """Zero columns up to ``width``: every module of an adapter has the adapter's rank."""
    return np.pad(matrix, ((0, 0), (0, width - matrix.shape[1])))


def _pad_rows(matrix: np.ndarray, height: int) -> np.ndarray:
    return np.pad(matrix, ((0, height - matrix.shape[0]), (0, 0)))
