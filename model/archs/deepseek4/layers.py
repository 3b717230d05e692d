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


def rope(x: mx.array, positions: np.ndarray, inv_freq: np.ndarray, inverse: bool = False):
    """Rotate interleaved pairs of the last ``2*len(inv_freq)`` dims of `x` ``(B, L, N, D)``
    at `positions` ``(L,)``; `inverse` applies the conjugate rotation."""
    B, L, N, D = x.shape
    rd = 2 * inv_freq.shape[0]
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # (L, rd/2)
    cos = mx.array(np.cos(angles), dtype=x.dtype)[None, :, None, :]
    sin = mx.array(np.sin(angles), dtype=x.dtype)[None, :, None, :]
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
