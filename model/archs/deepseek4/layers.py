"""Building blocks the DeepSeek-V4 modules share: bare GGUF tensors, interleaved RoPE with
YaRN, and the mHC stream mixing (DeepSeek-V4 reference ``inference/model.py``:
``precompute_freqs_cis``, ``apply_rotary_emb``, ``hc_split_sinkhorn``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
import numpy as np

if TYPE_CHECKING:
    from .model import ModelArgs


class Param(nn.Module):
    """A bare GGUF tensor (``name.weight`` or ``name.bias``)."""

    def __init__(self, shape: tuple[int, ...], attr: str = "weight", dtype=mx.float32):
        super().__init__()
        setattr(self, attr, mx.zeros(shape, dtype))


def rope_inv_freq(args: ModelArgs, ratio: int) -> np.ndarray:
    """float64 ``(rope_dim/2,)`` inverse frequencies: base 10000 on ratio-0 layers, else the
    compress base with YaRN interpolation (reference ``precompute_freqs_cis``; no mscale)."""
    dim = args.rope_dim
    base = args.compress_rope_theta if ratio else args.rope_theta
    freqs = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if not ratio:
        return freqs

    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(args.original_context_length / (rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low = max(math.floor(correction_dim(args.beta_fast)), 0)
    high = min(math.ceil(correction_dim(args.beta_slow)), dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / max(high - low, 0.001), 0, 1)
    smooth = 1 - ramp
    return freqs / args.rope_factor * (1 - smooth) + freqs * smooth


def host_angles(inv_freq: np.ndarray, positions: np.ndarray) -> tuple[mx.array, mx.array]:
    """float32 ``(L, R/2)`` cos and sin of ``positions[l] * inv_freq[i]``, computed in float64
    on the host and made into arrays for this call."""
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    return mx.array(np.cos(angles), mx.float32), mx.array(np.sin(angles), mx.float32)


def angle_table(inv_freq: np.ndarray, positions: np.ndarray) -> tuple[mx.array, mx.array]:
    """float32 ``(L, R/2)`` cosines and sines of ``positions[l] * inv_freq[i]`` (computed in
    float64).

    Integer positions in increasing arithmetic progression from 0 or above (a chunk's, or
    its compressed rows' ``g * ratio``) are sliced from a device table of positions
    ``0 .. 2^k - 1`` (at least 4,096) built once per `inv_freq` (`_device_table`); others
    are computed for the call (`host_angles`). Arrays made from host data in every layer
    of every chunk cost the GPU prefill dearly (docs/benchmarks.md, "RoPE angles from a
    device table")."""
    inv_freq = np.asarray(inv_freq, dtype=np.float64)
    L = positions.shape[0]
    affine = L > 0 and positions.dtype.kind in "iu"
    if affine:
        ints = positions.astype(np.int64)
        start, step = int(ints[0]), int(ints[1] - ints[0]) if L > 1 else 1
        affine = start >= 0 and step > 0 and np.array_equal(ints, start + step * np.arange(L))
    if not affine:
        return host_angles(inv_freq, positions)
    last = start + step * (L - 1)
    cos, sin = _device_table(inv_freq.tobytes(), max(4096, 1 << last.bit_length()))
    stop = last + 1
    return cos[start:stop:step], sin[start:stop:step]


# the largest device table built per frequency set: bytes of inv_freq -> (cos, sin)
_tables: dict[bytes, tuple[mx.array, mx.array]] = {}


def _device_table(inv_freq: bytes, length: int) -> tuple[mx.array, mx.array]:
    """cos and sin of ``p * inv_freq`` for ``p < length`` or more, float32 ``(n, R/2)``;
    a longer table replaces the shorter one (2 x 32 float32 per position: 256 MiB at 1M)."""
    held = _tables.get(inv_freq)
    if held is None or held[0].shape[0] < length:
        held = host_angles(np.frombuffer(inv_freq), np.arange(length))
        mx.eval(held)
        _tables[inv_freq] = held
    return held


def rope(x: mx.array, positions: np.ndarray, inv_freq: np.ndarray, inverse: bool = False):
    """Rotate interleaved pairs of the last ``2*len(inv_freq)`` dims of `x` ``(B, L, N, D)``
    at `positions` ``(L,)``; `inverse` applies the conjugate rotation."""
    B, L, N, D = x.shape
    rd = 2 * inv_freq.shape[0]
    cos, sin = angle_table(inv_freq, positions)
    cos, sin = cos.astype(x.dtype)[None, :, None, :], sin.astype(x.dtype)[None, :, None, :]
    if inverse:
        sin = -sin
    pairs = x[..., D - rd :].reshape(B, L, N, rd // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = mx.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(B, L, N, rd)
    return mx.concatenate([x[..., : D - rd], rotated], axis=-1)


def sinkhorn(comb: mx.array, iters: int, eps: float) -> mx.array:
    """Row softmax, then alternate column/row normalisation (reference ``hc_split_sinkhorn``)."""
    comb = mx.softmax(comb, axis=-1) + eps
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    return comb


def hc_mixes(h: mx.array, fn: mx.array, eps: float) -> mx.array:
    """``(..., hc, H)`` -> ``(..., n_mix)``: linear mixes of the RMS-scaled flat streams."""
    flat = h.reshape(*h.shape[:-2], -1).astype(mx.float32)
    return (flat @ fn.T) * mx.rsqrt((flat * flat).mean(axis=-1, keepdims=True) + eps)
